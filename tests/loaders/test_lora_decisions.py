"""Decision of `load_lora_weights` that must not flip: `network_alpha=` applies to every partition the file targets, a
file with `transformer.` and `transformer_ref.` keys gets it under both prefixes (scale alpha / rank per module)."""

from ._lora_helpers import TinyLoraPipeline, assert_deltas, canonical_lora, tiny_transformer


def test_network_alpha_reaches_both_partitions():
    fl2v, ref = tiny_transformer(0), tiny_transformer(1)
    pipe = TinyLoraPipeline(transformer=fl2v, transformer_ref=ref)
    skip = ("adaln", "norm_out")  # one rank (4) everywhere: one scale to check
    lora = canonical_lora(fl2v, seed=3, skip=skip)
    state_dict = {}
    for prefix in ("transformer", "transformer_ref"):
        for module, (A, B) in lora.items():
            state_dict[f"{prefix}.{module}.lora_A.weight"] = A.clone()
            state_dict[f"{prefix}.{module}.lora_B.weight"] = B.clone()

    report = pipe.load_lora_weights(state_dict, "both", network_alpha=8)

    assert set(report.components) == {"transformer", "transformer_ref"}
    assert report.components["transformer"].alphas == report.components["transformer_ref"].alphas == {8.0: len(lora)}
    assert_deltas(fl2v, lora, "both", scale=8 / 4)
    assert_deltas(ref, lora, "both", scale=8 / 4)
