"""Shared by the processors' plan tests."""


def spy_on_plan_call(monkeypatch, processor_cls):
    """Record every plan ``processor_cls.plan_call`` makes; returns the list, in order."""
    planned = []
    plan_call = processor_cls.plan_call

    def spy(self, call):
        planned.append(plan_call(self, call))
        return planned[-1]

    monkeypatch.setattr(processor_cls, "plan_call", spy)
    return planned
