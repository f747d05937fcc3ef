"""diffusers' ``MiniMaxH3Transformer3DModel`` names in the reference / ComfyUI naming (``blocks.N.mlp.fc1``,
``video_patch_proj``, ``final_layer.*`` ...): the names diffusers' ``convert_minimax_h3_transformer_checkpoint_to_diffusers``
maps from, for the writers of files in that layout (single-file DiTs, ComfyUI-named LoRAs). Fused layouts (the
``qkv_proj`` stack, ``mlp.fc1``'s ``[gate; value]`` order) are the writers' business: this maps names only."""

from __future__ import annotations


_BLOCKS = (("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks."))
_TOP_LEVEL = {
    "proj_in.": "video_patch_proj.",
    "audio_proj_in.": "audio_patch_proj.",
    "context_embedder.": "condition_proj.",
    "proj_out.": "final_layer.video_out.",
    "audio_proj_out.": "final_layer.audio_out.",
}
# applied in order, once the block prefix is mapped
_RENAMES = (
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("norm_out.norm.", "final_layer.norm."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    (".attn.norm_q.", ".attn.q_norm."),
    (".attn.norm_k.", ".attn.k_norm."),
    (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."),
    (".ff.net.2.", ".mlp.fc2."),
)


def native_name(name: str) -> str:
    """``name`` (a parameter such as ``transformer_blocks.3.ff.net.2.weight`` or a module such as
    ``norm_out.linear``) in the reference / ComfyUI naming."""
    name += "."  # a module name then matches the patterns a parameter name does
    for old, new in _BLOCKS:
        if name.startswith(old):
            name = new + name[len(old) :]
    for old, new in _TOP_LEVEL.items():
        if name.startswith(old):
            return (new + name[len(old) :])[:-1]
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name[:-1]
