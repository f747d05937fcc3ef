"""Decisions of `parallel_vae_decode` that must not flip: the tiles are split by the rank *within the group* (not the
global rank), and the latents are cast to the VAE's dtype before anything is decoded.

This process plays rank 1 of a 2-rank group whose members are global ranks 2 and 3 (so its global rank is 3); the
collectives are faked: the other member's tiles are decoded here, outside the product code, with the same decoder."""

import pytest
import torch

from diffusers_h3.parallel import vae as parallel_vae
from diffusers_h3.testing.tiny import tiny_vae


GROUP = object()
GLOBAL_RANK, GROUP_RANK, GROUP_SIZE, WORLD_SIZE = 3, 1, 2, 4


def _float64_tiled_vae():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = tiny_vae().to(torch.float64)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_min_overlap_height=16,
                      tile_sample_min_overlap_width=16)  # fmt: skip
    return vae


@pytest.fixture
def second_member_of_a_subgroup(monkeypatch):
    """Fake collectives; returns what they saw (the units, the tiles this process decoded)."""
    dist = torch.distributed
    seen = {"units": None, "decoded_here": [], "faking": False}
    others = {}

    def decode_units(vae, units, group):
        seen["units"] = units
        handle = vae.post_quant_conv.register_forward_pre_hook(
            lambda m, args: None if seen["faking"] else seen["decoded_here"].append(args[0])
        )
        try:
            return original(vae, units, group)
        finally:
            handle.remove()

    def all_gather_object(objects, obj, group=None):
        assert group is GROUP
        vae, units = seen["vae"], seen["units"]
        seen["faking"] = True
        with torch.no_grad():  # the other member (group rank 0) decodes its share
            others.update({k: vae.decoder(vae.post_quant_conv(units[k])) for k in range(0, len(units), GROUP_SIZE)})
        seen["faking"] = False
        objects[GROUP_RANK] = obj
        objects[1 - GROUP_RANK] = {k: (tuple(t.shape), t.dtype) for k, t in others.items()}

    broadcasts = iter(range(10**6))

    def broadcast(tensor, src=None, group=None, group_src=None, **kwargs):
        assert group is GROUP and src is None, "a subgroup broadcast names its source by group rank"
        k = next(broadcasts)
        if group_src != GROUP_RANK:
            tensor.copy_(others[k])

    original = parallel_vae._decode_units_in_parallel
    monkeypatch.setattr(parallel_vae, "_decode_units_in_parallel", decode_units)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: GROUP_SIZE if group is GROUP else WORLD_SIZE)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: GROUP_RANK if group is GROUP else GLOBAL_RANK)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    return seen


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # inside diffusers VAE norms
def test_tiles_are_split_by_the_rank_within_the_group_in_the_vae_dtype(second_member_of_a_subgroup):
    seen = second_member_of_a_subgroup
    vae = _float64_tiled_vae()
    seen["vae"] = vae
    latents = torch.randn((1, 4, 3, 2, 4), generator=torch.Generator().manual_seed(0))  # float32, the VAE is float64

    out = parallel_vae.parallel_vae_decode(vae, latents, group=GROUP)

    units = seen["units"]
    assert len(units) > GROUP_SIZE and all(u.dtype == torch.float64 for u in units)
    mine = [units[k] for k in range(GROUP_RANK, len(units), GROUP_SIZE)]  # group rank 1: units 1, 3, 5, ...
    assert len(seen["decoded_here"]) == len(mine)
    assert all(torch.equal(decoded, unit) for decoded, unit in zip(seen["decoded_here"], mine))
    with torch.no_grad():
        serial = vae.decode(latents.to(torch.float64)).sample
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, serial, atol=0, rtol=0)
