"""Hook names from short kinds, as transformer-lens's `get_act_name` spells them:
`act_name("pattern", 3)` is "blocks.3.attn.hook_pattern"."""
from __future__ import annotations

import functools
import operator
from typing import Literal, Optional

# kind -> where it lives inside block l ("" is the block itself)
_BLOCK_KINDS = {
    "resid_pre": "", "resid_mid": "", "resid_post": "", "attn_out": "", "mlp_out": "",
    "attn_in": "", "q_input": "", "k_input": "", "v_input": "", "mlp_in": "",
    "q": "attn", "k": "attn", "v": "attn", "rot_q": "attn", "rot_k": "attn", "attn_scores": "attn",
    "pattern": "attn", "z": "attn", "result": "attn", "q_normed": "attn", "k_normed": "attn",
    "pre": "mlp", "mid": "mlp", "post": "mlp", "pre_linear": "mlp",
}
_ALIASES = {"attn": "pattern", "scores": "attn_scores", "attn_logits": "attn_scores", "query": "q", "key": "k",
            "value": "v", "mlp_pre": "pre", "mlp_mid": "mid",
            "mlp_post": "post"}
_NORM_KINDS = ("scale", "normalized")
_TOP_KINDS = ("embed", "pos_embed")


BlockNorm = Literal["ln1", "ln2", "ln1_post", "ln2_post", "mlp.ln"]
_BLOCK_NORMS = ("ln1", "ln2", "ln1_post", "ln2_post", "mlp.ln")  # mlp.ln: a SoLU MLP's LayerNorm over d_mlp


def act_name(kind: str, layer: Optional[int] = None, norm: Optional[BlockNorm] = None) -> str:
    """The hook name of `kind` in block `layer`.

    kinds: resid_pre resid_mid resid_post attn_out mlp_out; attn_in q_input k_input v_input mlp_in (the
    use_attn_in / use_split_qkv_input / use_hook_mlp_in inputs); q (query) k (key) v (value) rot_q rot_k
    attn_scores (scores, attn_logits) pattern (attn) z result; pre (mlp_pre) mid (mlp_mid: SoLU-LN MLPs) post
    (mlp_post) pre_linear; q_normed k_normed (Qwen3); scale normalized (of `norm` ln1/ln2/ln1_post/ln2_post/mlp.ln in
    block `layer`, or of ln_final without a layer); embed pos_embed (no layer).
    The name is only built here: the model's `hook_point(name)` says whether this model has it.
    """
    # analyses build the same names thousands of times a call: plain ints and strings are remembered
    if type(kind) is str and (layer is None or type(layer) is int) and (norm is None or type(norm) is str):
        return _remembered_name(kind, layer, norm)
    return _build_name(kind, layer, norm)


@functools.lru_cache(maxsize=4096)
def _remembered_name(kind: str, layer: Optional[int], norm: Optional[str]) -> str:
    return _build_name(kind, layer, norm)


def _build_name(kind, layer, norm) -> str:
    kind = _ALIASES.get(kind, kind)
    if kind in _TOP_KINDS:
        if layer is not None or norm is not None:
            raise ValueError(f"{kind!r} is not inside a block; call act_name({kind!r}) without a layer")
        return f"hook_{kind}"
    if kind in _NORM_KINDS:
        if layer is None and norm is None:
            return f"ln_final.hook_{kind}"
        if layer is None or norm not in _BLOCK_NORMS:
            raise ValueError(f"{kind!r} of a block's norm needs a layer and norm='ln1' or 'ln2' (or a sandwich block's "
                             "'ln1_post' / 'ln2_post', or a SoLU MLP's 'mlp.ln') "
                             f"(got layer={layer!r}, norm={norm!r}); without either it is ln_final's")
        return f"blocks.{_layer(layer)}.{norm}.hook_{kind}"
    if kind not in _BLOCK_KINDS:
        valid = sorted(set(_BLOCK_KINDS) | set(_ALIASES) | set(_NORM_KINDS) | set(_TOP_KINDS))
        raise ValueError(f"unknown activation kind {kind!r}; choose one of: {', '.join(valid)}")
    if layer is None:
        raise ValueError(f"{kind!r} is inside a block: give its layer, e.g. act_name({kind!r}, 0)")
    if norm is not None:
        raise ValueError(f"norm={norm!r} only applies to 'scale' and 'normalized'")
    where = _BLOCK_KINDS[kind]
    return f"blocks.{_layer(layer)}.{where + '.' if where else ''}hook_{kind}"


def _layer(layer) -> int:
    # operator.index accepts what indexes like an int (numpy integers, 0-d integer tensors), so a
    # layer from np.argmax or tensor.argmax() gives "blocks.3", not "blocks.tensor(3)"
    try:
        index = None if isinstance(layer, bool) else operator.index(layer)
    except TypeError:
        index = None
    if index is None or index < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    return index

