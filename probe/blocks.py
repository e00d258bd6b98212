"""The residual blocks: how attention and the MLP meet the residual stream, one class per arrangement of the norms.

Each reads top to bottom with its hook points inline; the config picks one at construction (HookedDecoder)."""
from __future__ import annotations

from functools import partial

import torch
from einops import repeat
from torch import nn

from probe.attention import PerHeadInputs
from probe.shared_attention import attention_class
from probe.config import DecoderConfig, Norm
from probe.hooks import HookPoint, observed
from probe.sparse_indexer import make_latent_attention
from probe.linear_attention import GatedDeltaNet
from probe.selective_scan import MambaMixer
from probe.short_conv import ShortConvMixer
from probe.state_space import Mamba2Mixer
from probe.moe import make_mlp
from probe.norm import make_norm


class PreNormBlock(nn.Module):
    """The pre-norm residual block (GPT-2, Llama): h = x + attn(ln1(x)); y = h + mlp(ln2(h))."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        # (ModernBERT's layer 0 reads the residual itself: the embedding's own norm is its attention's)
        self.ln1 = make_norm(cfg, foldable=True, ends=True, kind=None if cfg.first_ln1 or layer else Norm.NONE)
        # multi-head latent attention where the config has it (DeepSeek), the same hook points but for its latents'
        self.attn = attention_class(cfg, layer)(cfg, layer) if cfg.latent_attention is None else make_latent_attention(cfg, layer)
        self.ln2 = make_norm(cfg, foldable=True, ends=True)
        self.mlp = make_mlp(cfg, layer)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        # per-head copies of what attention reads, before its norm (transformer-lens's use_attn_in and
        # use_split_qkv_input): computed only while hooked or cached by name, see attention_input
        self.hook_attn_in = HookPoint(opt_in=True, by_name=True)  # [batch pos head d_model]
        self.hook_q_input = HookPoint(opt_in=True, by_name=True)  # [batch pos head d_model]
        self.hook_k_input = HookPoint(opt_in=True, by_name=True)  # [batch pos kv_head d_model]
        self.hook_v_input = HookPoint(opt_in=True, by_name=True)  # [batch pos kv_head d_model]
        self.split_qkv_input = False  # set_use_split_qkv_input: see attention_input
        self.hook_attn_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_mid = HookPoint()  # [batch pos d_model]
        # [batch pos d_model]: what the MLP reads, before its norm; a copy of the residual, as in transformer-lens,
        # so an edit made in place here reaches the MLP alone
        self.hook_mlp_in = HookPoint(opt_in=True, copies=True)
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past, qk_pos))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)

    def attention_input(self, resid: torch.Tensor, norm: nn.Module, normed=None):
        """norm(resid) [batch pos d_model] (`normed`, where the block has it already), what attention reads. While a
        per-head input point is hooked, each head reads its own copy instead, normed separately: PerHeadInputs of
        [batch pos head d_model] queries' and [batch pos kv_head d_model] keys' and values' inputs (one per query head
        once ungrouped), so an edit reaches one head's q, k or v alone."""
        points = (self.hook_attn_in, self.hook_q_input, self.hook_k_input, self.hook_v_input)
        if not any(observed(point) for point in points):
            return norm(resid) if normed is None else normed
        n_heads, kv_heads = self.attn.n_heads, self.attn.hooked_kv_heads  # one per query head once ungrouped
        # repeat may return a broadcast view of resid: real copies, so an in-place edit stays in its head
        per_head = partial(repeat, resid, "batch pos d_model -> batch pos head d_model")
        if self.split_qkv_input:
            # transformer-lens's precedence: with use_split_qkv_input on, q, k and v read copies of the residual of
            # their own, and hook_attn_in (use_attn_in) only observes: an edit there reaches nothing
            if observed(self.hook_attn_in):
                self.hook_attn_in(per_head(head=n_heads).clone())
            q_in, kv_in = per_head(head=n_heads).clone(), per_head(head=kv_heads)
        else:
            q_in = self.hook_attn_in(per_head(head=n_heads).clone())
            if kv_heads != n_heads and observed(self.hook_attn_in):
                raise ValueError("hook_attn_in has one copy per query head, but this model's keys and values have "
                                 "fewer heads (grouped-query attention); hook hook_k_input / hook_v_input instead, or "
                                 "compute keys and values per query head: model.set_ungroup_grouped_query_attention(True)")
            kv_in = q_in if kv_heads == n_heads else per_head(head=kv_heads)
        # copies made before any hook runs, so an in-place edit of a query input never reaches a key or value
        k_in, v_in = kv_in.clone(), kv_in.clone()
        q_in = self.hook_q_input(q_in)
        return PerHeadInputs(norm(q_in), norm(self.hook_k_input(k_in)), norm(self.hook_v_input(v_in)))


class PostNormBlock(PreNormBlock):
    """The post-norm residual block (Vaswani et al. 2017, GPT-1): h = ln1(x + attn(x)); y = ln2(h + mlp(h)).

    Same components and hook names; resid_mid and resid_post are the normalised sums that flow on."""

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, nn.Identity()), positions, allowed, past, qk_pos))
        resid_mid = self.hook_resid_mid(self.ln1(resid_pre + attn_out))
        mlp_out = self.hook_mlp_out(self.mlp(self.hook_mlp_in(resid_mid)))
        return self.hook_resid_post(self.ln2(resid_mid + mlp_out))


class ParallelBlock(PreNormBlock):
    """The parallel residual block (GPT-NeoX, Pythia): y = x + attn(ln1(x)) + mlp(ln2(x)).

    Both sublayers read the same residual, so there is no residual between them: no hook_resid_mid."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        del self.hook_resid_mid

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past, qk_pos))
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_pre))))
        return self.hook_resid_post(resid_pre + attn_out + mlp_out)


class SandwichBlock(PreNormBlock):
    """Norms on both sides of each sublayer (Gemma 2): h = x + ln1_post(attn(ln1(x))); y = h + ln2_post(mlp(ln2(h))).

    hook_attn_out and hook_mlp_out are the normalised writes, what the residual stream receives. Without input norms
    (OLMo 2: cfg.input_norms False) ln1 and ln2 are identities, h = x + ln1_post(attn(x)), as a model without norms
    has them."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        if not cfg.input_norms:
            self.ln1, self.ln2 = (make_norm(cfg, foldable=True, ends=True, kind=Norm.NONE) for _ in range(2))
        self.ln1_post = make_norm(cfg, ends=True)
        self.ln2_post = make_norm(cfg, ends=True)

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.ln1_post(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past, qk_pos)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp(self.ln2(self.hook_mlp_in(resid_mid)))))
        return self.hook_resid_post(resid_mid + mlp_out)


class AttnOnlyBlock(PreNormBlock):
    """An attention-only block (toy models, transformer-lens's attn_only): y = x + attn(ln1(x)).

    No MLP, so no ln2 and nothing between the sublayers: no hook_resid_mid, hook_mlp_in or hook_mlp_out."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        del self.ln2, self.mlp, self.hook_resid_mid, self.hook_mlp_in, self.hook_mlp_out

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past, qk_pos))
        return self.hook_resid_post(resid_pre + attn_out)


class LinearAttentionBlock(nn.Module):
    """A pre-norm block whose token mixer is linear attention (Qwen3.5's Gated DeltaNet layers):
    h = x + linear_attn(ln1(x)); y = h + mlp(ln2(h)).

    hook_attn_out is the mixer's write, so the residual stream decomposes by layer as in every other block; there
    are no attention heads, so no `attn`, patterns or per-head input points. `allowed` is the new positions' padding
    mask [batch pos] here (True: a real token), as the model hands it to these blocks."""

    mixer_name = "linear_attn"  # the mixer's attribute: its hook points' names, blocks.L.<mixer_name>.hook_*
    kind = "linear-attention (Gated DeltaNet)"  # what the layer is, in messages

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.ln1 = make_norm(cfg, foldable=True, ends=True)
        setattr(self, self.mixer_name, self.make_mixer(cfg))
        self.ln2 = make_norm(cfg, foldable=True, ends=True)
        self.mlp = make_mlp(cfg, layer)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_attn_out = HookPoint()  # [batch pos d_model]: the linear attention's write
        self.hook_resid_mid = HookPoint()  # [batch pos d_model]
        self.hook_mlp_in = HookPoint(opt_in=True, copies=True)  # [batch pos d_model], as PreNormBlock's
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    @staticmethod
    def make_mixer(cfg: DecoderConfig) -> nn.Module:
        return GatedDeltaNet(cfg)

    def __getattr__(self, name: str):
        if name in ATTENTION_PARTS:  # what code written for attention blocks reaches for: say why it is not here
            raise AttributeError(f"this block is a {self.kind} layer: it has no attention heads, so no {name}; its mixer is "
                                 f"{self.mixer_name} (hook points blocks.L.{self.mixer_name}.hook_*)")
        return super().__getattr__(name)

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(getattr(self, self.mixer_name)(self.ln1(resid_pre), allowed, past))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)


class StateSpaceBlock(LinearAttentionBlock):
    """A pre-norm block whose token mixer is a Mamba-2 state-space layer (Granite 4.0-H's): h = x + mixer(ln1(x));
    y = h + mlp(ln2(h)), the mixer under the bridge's name, `mixer`."""

    mixer_name = "mixer"
    kind = "state-space"

    @staticmethod
    def make_mixer(cfg: DecoderConfig) -> nn.Module:
        return MambaMixer(cfg) if cfg.state_space.kind == "mamba1" else Mamba2Mixer(cfg)


class StateSpaceOnlyBlock(StateSpaceBlock):
    """A Mamba-2 layer without an MLP (Mamba-2's own models: `attn_only`): y = x + mixer(ln1(x)); no hook_resid_mid,
    MLP or ln2 points, as an attention-only block has none."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        nn.Module.__init__(self)
        self.ln1 = make_norm(cfg, foldable=True, ends=True)
        self.mixer = self.make_mixer(cfg)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_attn_out = HookPoint()  # [batch pos d_model]: the mixer's write
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        return self.hook_resid_post(resid_pre + self.hook_attn_out(self.mixer(self.ln1(resid_pre), allowed, past)))


class ShortConvBlock(LinearAttentionBlock):
    """A pre-norm block whose token mixer is LFM2's gated short convolution: h = x + conv(ln1(x)); y = h + mlp(ln2(h)),
    the mixer under transformers' and the bridge's name, `conv`."""

    mixer_name = "conv"
    kind = "short-convolution (LFM2)"

    @staticmethod
    def make_mixer(cfg: DecoderConfig) -> nn.Module:
        return ShortConvMixer(cfg)


class MLPOnlyBlock(nn.Module):
    """A layer of an MLP (or experts) alone (NemotronH's "-" and "E" layers): y = x + mlp(ln2(x)). Its norm is ln2 and
    its write hook_mlp_out, as every block's MLP's are, so a residual decomposition names it `L{l} mlp`; it has no
    attention, ln1 or hook_attn_out."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.ln2 = make_norm(cfg, foldable=True, ends=True)
        self.mlp = make_mlp(cfg, layer)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_mlp_in = HookPoint(opt_in=True, copies=True)  # [batch pos d_model], as PreNormBlock's
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def __getattr__(self, name: str):
        if name in ATTENTION_PARTS:  # what code written for attention blocks reaches for: say why it is not here
            raise AttributeError(f"this block is an MLP-only layer: it has no attention heads, so no {name}; its one "
                                 "sublayer is mlp (hook points blocks.L.mlp.hook_*, blocks.L.hook_mlp_out)")
        return super().__getattr__(name)

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        return self.hook_resid_post(resid_pre + self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_pre)))))


class ParallelHybridBlock(PreNormBlock):
    """Attention and a Mamba-2 mixer side by side on one norm's output, their writes summed (Falcon-H1's parallel
    hybrid): h = x + attn(ln1(x)) + mamba(ln1(x)); y = h + mlp(ln2(h)).

    hook_attn_out is attention's write and hook_mixer_out the mixer's (`mamba`, transformers' and TL 4's bridge's
    name), so the residual stream decomposes into heads, the mixer and the MLP. `allowed` is the pair (attention's
    mask of the keys each query sees, the new positions' padding mask [batch pos]) that mask_keys asks for."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.mamba = Mamba2Mixer(cfg, cfg.parallel_state_space)
        self.hook_mixer_out = HookPoint()  # [batch pos d_model]: the mixer's write

    def forward(self, resid_pre, positions=None, allowed=(None, None), past=None, qk_pos=None):
        keys, real = allowed
        resid_pre = self.hook_resid_pre(resid_pre)
        normed = self.ln1(resid_pre)  # (per-head input points, when hooked, give attention copies of their own)
        mixer_out = self.hook_mixer_out(self.mamba(normed, real, past))
        attn_in = self.attention_input(resid_pre, self.ln1, normed)
        attn_out = self.hook_attn_out(self.attn(attn_in, positions, keys, past, qk_pos))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out + mixer_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)


# a PreNormBlock's attention and per-head input points, which a linear-attention block has none of
ATTENTION_PARTS = ("attn", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "split_qkv_input",
                   "attention_input")


def attention_blocks(blocks) -> list[nn.Module]:
    """The blocks among `blocks` that have attention heads: all but a hybrid model's linear-attention and MLP-only ones."""
    return [block for block in blocks if not isinstance(block, (LinearAttentionBlock, MLPOnlyBlock))]


PADDING = "padding"  # the key of the new positions' padding mask among a forward's masks


def mask_keys(cfg: DecoderConfig) -> list:
    """Which of a forward's masks each block is handed as `allowed`: its window's mask of the keys each query sees,
    or (a linear-attention block) the padding mask, or (a parallel hybrid block) both, a pair of keys."""
    return [PADDING if cfg.layer_is_linear(layer) else (cfg.layer_window(layer), PADDING)
            if cfg.layer_has_parallel_mixer(layer) or cfg.layer_has_shared_block(layer) else cfg.layer_mask_key(layer)
            for layer in range(cfg.n_layers)]


def masks_for(masks: dict, key):
    """The mask (or, for a pair of keys, the pair of masks) mask_keys names for a block, from a forward's `masks`."""
    return tuple(masks[k] for k in key) if isinstance(key, tuple) else masks[key]


Block = PreNormBlock
