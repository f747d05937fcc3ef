import pytest

from ._inputs import tile_plan


@pytest.fixture
def plan():
    return tile_plan()
