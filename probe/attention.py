"""Causal self-attention (multi-head, grouped-query or multi-query) with every intermediate hooked."""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from probe.hooks import HookPoint, observed
from probe.config import DecoderConfig
from probe.config_gate import ACTIVATIONS as GATE_ACTIVATIONS, output_gate_of
from probe.embedding import make_alibi
from probe.rotary import make_rotary
from probe.factored import FactoredMatrix
from probe.kv_cache import LayerKV
from probe.norm import make_qk_norm, make_value_norm, make_z_norm
from probe.softcap import make_softcap
from probe.tl_attention_buffers import TLAttentionBuffers
from probe.tl_weights import WritableWeights, bias_view, weight_view


class PerHeadInputs(NamedTuple):
    """Each head's own normed input (see Block.attention_input): q [batch pos head d_model], k and v
    [batch pos kv_head d_model]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class ProjectionInput(nn.Module):
    """What one of q, k and v reads, hooked apart from the other two (transformer-lens 4's `attn.q.hook_in`): an edit
    there reaches that projection alone. A point of the bridge's naming only (HookedTransformer hooks per-head copies
    instead, `hook_q_input`), so caches of everything list it only on a model named as the bridge names."""

    def __init__(self):
        super().__init__()
        self.hook_in = HookPoint(bridge_only=True)  # [batch pos d_model]


def per_head(t: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    """t with `heads` entries along dim: as it is, or each key/value head repeated for the adjacent query heads of
    its group."""
    return t if t.shape[dim] == heads else t.repeat_interleave(heads // t.shape[dim], dim=dim)


def attention_softmax(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """The pattern [batch head query_pos key_pos] of `scores`; with `sinks` [head], each head's softmax also takes its
    sink logit, whose share is dropped after it (no value follows it), so a row sums to less than 1."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def visible_keys(allowed: Optional[torch.Tensor], causal: bool, n: int, device) -> Optional[torch.Tensor]:
    """`allowed` spelled out: None means earlier keys in a causal model (no cache then: the n keys are the queries),
    and stays None (every key) in a bidirectional one."""
    if allowed is None and causal:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return allowed


class Attention(WritableWeights, TLAttentionBuffers, nn.Module):
    # whether the layer projects its own keys and values; subclasses project fewer (probe.shared_attention)
    projects = (True, True)

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.n_ctx, self.window = cfg.n_ctx, cfg.layer_window(layer)  # what TL's mask buffer reads (the model masks)
        self.n_heads, self.n_kv_heads = cfg.layer_heads(layer), cfg.layer_kv_heads(layer)
        self.d_head = d_head = cfg.layer_d_head(layer)  # Gemma 4's full-attention layers have wider heads
        self.qkv_sizes = [self.n_heads * d_head, *(self.n_kv_heads * d_head * own for own in self.projects)]
        # q of every head, then k and v of every key/value head, in one matmul
        self.qkv = nn.Linear(cfg.d_model, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        self.out = nn.Linear(self.n_heads * d_head, cfg.d_model, bias=cfg.out_bias)
        self.scale = (d_head if cfg.attn_scale_dim is None else cfg.attn_scale_dim) ** -0.5
        if cfg.attn_scale_by_layer:  # GPT-2's scale_attn_by_inverse_layer_idx: deeper layers' scores shrink
            self.scale /= layer + 1
        self.score_cap = make_softcap(cfg.attn_softcap)
        # each head's sink logit (GPT-OSS), the softmax's extra column; None: none
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attn_sinks else None
        self.fusable = cfg.attn_softcap is None and not cfg.attn_sinks  # the fused kernel caps no scores, has no sink
        self.causal = not cfg.bidirectional  # what `allowed=None` means: earlier keys only, or every key
        # how many key/value heads the hooks see: one per key/value head, or one per query head once
        # transformer-lens's ungroup_grouped_query_attention is on (HookedDecoder.set_ungroup_grouped_query_attention)
        self.hooked_kv_heads = self.n_kv_heads
        self.q, self.k, self.v = ProjectionInput(), ProjectionInput(), ProjectionInput()
        self.hook_q = HookPoint()  # [batch pos head d_head]
        self.hook_k = HookPoint()  # [batch pos kv_head d_head]
        self.hook_v = HookPoint()  # [batch pos kv_head d_head]
        # Qwen3 normalises each head's q and k over d_head after the projection (transformer-lens's names): rotary
        # and the scores use hook_q_normed / hook_k_normed; without it these are identities, not hook points
        self.q_norm, self.k_norm = make_qk_norm(cfg, self.n_heads, d_head), make_qk_norm(cfg, self.n_kv_heads, d_head)
        self.hook_q_normed = HookPoint() if cfg.qk_norm else nn.Identity()  # [batch pos head d_head]
        self.hook_k_normed = HookPoint() if cfg.qk_norm else nn.Identity()  # [batch pos kv_head d_head]
        # Gemma 4 normalises each head's values too, with no weight (cfg.value_norm); an identity otherwise
        self.v_norm = make_value_norm(cfg, d_head)
        self.hook_v_normed = HookPoint() if cfg.value_norm else nn.Identity()  # [batch pos kv_head d_head]
        self.norm_after_rope = cfg.qk_norm_after_rope
        self.clip = cfg.clip_qkv  # OLMo-7B-0424's clamp of q, k and v; None: none
        # gated attention (Qwen3.5): each head's z times sigmoid of a gate read, like q, from the queries' input
        self.gate = None
        if cfg.attn_output_gate:  # (Laguna's: a softplus of one logit per head, cfg.output_gate)
            gate = output_gate_of(cfg)
            self.gate_width, self.gate_fn = gate.width(d_head), GATE_ACTIVATIONS[gate.activation]
            self.gate = nn.Linear(cfg.d_model, self.n_heads * self.gate_width, bias=cfg.qkv_bias)
            self.hook_q_gate = HookPoint()  # [batch pos head d_head (or 1)]: the gate's logits, before its function
        self.rotary = make_rotary(cfg, layer)
        self.alibi = make_alibi(cfg, self.n_heads)  # ALiBi's distance penalty on the scores; None otherwise
        if self.rotary is not None:
            self.hook_rot_q = HookPoint()  # [batch pos head d_head]: q after the rotation
            self.hook_rot_k = HookPoint()  # [batch pos kv_head d_head]
        # what a hidden key's score reads: -inf, or the IGNORE of a state dict an older transformer-lens saved (-1e5)
        self.masked_score = float("-inf")
        self.hook_attn_scores = HookPoint()  # [batch head query_pos key_pos]: scaled, capped, masked, pre-softmax
        self.hook_pattern = HookPoint()  # [batch head query_pos key_pos]
        self.hook_z = HookPoint()  # [batch pos head d_head]: pattern-weighted values
        # BitNet normalises every head's z together before W_O (cfg.sub_norms); identities elsewhere
        self.z_norm = make_z_norm(cfg, self.n_heads, d_head)
        self.hook_z_normed = HookPoint() if cfg.sub_norms else nn.Identity()  # [batch pos head d_head]: what W_O reads
        self.hook_result = HookPoint(opt_in=True)  # [batch pos head d_model]: each head's write, without b_O

    def forward(
        self,
        x: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        allowed: Optional[torch.Tensor] = None,
        past: Optional[LayerKV] = None,
        qk_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [batch pos d_model]; positions [batch pos] (None: 0, 1, ...); `allowed` [batch 1 query_pos key_pos] says which
        keys each query may see (None: plain causal, or every key in a bidirectional model); `past` holds earlier passes' keys and values; `qk_pos`
        [batch pos d_model], shortformer positions, joins the queries' and keys' inputs but not the values'."""
        if positions is not None and positions.is_floating_point():
            raise TypeError("Attention(x, positions, ...) takes one input and integer positions, not transformer-lens's "
                            "attn(query_input, key_input, value_input): call attn(x) with the normalised residual, or "
                            "give heads their own inputs with model.set_use_split_qkv_input(True)")
        q, k, v = self.project(x)
        if qk_pos is not None:  # (x + qk_pos) @ W_Q is x @ W_Q + qk_pos @ W_Q: one more matmul, no second q/k/v pass
            n_q, n_kv = self.qkv_sizes[:2]
            pos_qk = F.linear(qk_pos, self.qkv.weight[: n_q + n_kv])
            q = q + rearrange(pos_qk[..., :n_q], "batch pos (head d_head) -> batch pos head d_head", d_head=self.d_head)
            k = k + rearrange(pos_qk[..., n_q:], "batch pos (head d_head) -> batch pos head d_head", d_head=self.d_head)
        k, v = per_head(k, self.hooked_kv_heads), per_head(v, self.hooked_kv_heads)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if not self.norm_after_rope:
            q, k = self.hook_q_normed(self.q_norm(q)), self.hook_k_normed(self.k_norm(k))
        v = self.hook_v_normed(self.v_norm(v))
        if self.clip is not None:  # after the norms, before rotary (transformers' and TL's place; TL hooks nothing here)
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        if self.rotary is not None:
            q, k = self.hook_rot_q(self.rotary(q, positions)), self.hook_rot_k(self.rotary(k, positions))
        if self.norm_after_rope:  # HunYuan normalises the rotated q and k (its w does not commute with the rotation)
            q, k = self.hook_q_normed(self.q_norm(q)), self.hook_k_normed(self.k_norm(k))
        key_positions = positions
        if past is not None:
            # (the keys' positions are kept only where ALiBi reads them)
            k, v, key_positions = past.append(k, v, None if self.alibi is None else positions)
        return self.attend(x, q, k, v, positions, key_positions, allowed)

    def attend(self, x, q, k, v, positions, key_positions, allowed) -> torch.Tensor:
        """The layer's write [batch pos d_model] from its rotated queries [batch pos head d_head] and every key and
        value it sees [batch key_pos kv_head d_head] (at `key_positions`, which ALiBi reads); `x` is the layer's
        input, which an output gate reads."""
        k, v = per_head(k, self.n_heads), per_head(v, self.n_heads)
        bias = None if self.alibi is None else self.alibi(positions, key_positions, q.shape[1], k.shape[1]).to(q.dtype)
        if not self.fusable or observed(self.hook_attn_scores) or observed(self.hook_pattern):
            z = self._attend_explicitly(q, k, v, allowed, bias)
        else:  # nothing observes the pattern: let the fused kernel avoid materialising it
            if bias is not None:  # the kernel adds a float mask to the scores: the bias, -inf where hidden
                visible = visible_keys(allowed, self.causal, q.shape[1], q.device)
                allowed = bias if visible is None else bias.masked_fill(~visible, float("-inf"))
            z = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=allowed, is_causal=allowed is None and self.causal, scale=self.scale,
            ).transpose(1, 2)
        if self.gate is not None:
            z = z * self.gate_fn(self.hook_q_gate(self._gate_logits(x)))
        z = self.hook_z_normed(self.z_norm(self.hook_z(z)))
        if observed(self.hook_result):
            result = self.hook_result(
                einsum(z, self.W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")
            )
            return result.sum(dim=2) + (self.out.bias if self.out.bias is not None else 0.0)
        return self.out(rearrange(z, "batch pos head d_head -> batch pos (head d_head)"))

    def project(self, x: Union[torch.Tensor, PerHeadInputs]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch pos head d_head], k and v [batch pos kv_head d_head] from x [batch pos d_model] in one matmul
        (three while one of their own inputs is hooked), or from each head's own input (keys' and values' inputs
        may be one per query head: then so are k and v)."""
        if isinstance(x, torch.Tensor):
            inputs = self.projection_inputs()
            if any(observed(part.hook_in) for part in inputs):
                # each projection reads its own input, q's first, as on the bridge: an edit in place at one input
                # reaches the projections after it, not those before
                biases = (None,) * 3 if self.qkv.bias is None else self.qkv.bias.split(self.qkv_sizes)
                qkv = torch.cat([F.linear(part.hook_in(x), weight, bias) for part, weight, bias
                                 in zip(inputs, self.qkv.weight.split(self.qkv_sizes), biases)], dim=-1)
            else:
                qkv = self.qkv(x)
            n_q, n_kv = self.qkv_sizes[:2]
            # slices, not split(): autograd lets a hook edit one slice in place (`v[:, :, head] = 0`, as
            # transformer-lens code does), but not one of split's several outputs
            parts = qkv[..., :n_q], qkv[..., n_q:n_q + n_kv], qkv[..., n_q + n_kv:]
            return tuple(rearrange(t, "batch pos (head d_head) -> batch pos head d_head", d_head=self.d_head)
                         for t in parts)
        biases = [self._qkv_bias(part) for part in range(3)]
        return tuple(
            einsum(inp, per_head(w, inp.shape[2], dim=0), "batch pos head d_model, head d_model d_head -> batch pos head d_head")
            + (0.0 if b is None else per_head(b, inp.shape[2], dim=0))
            for inp, w, b in zip(x, (self.W_Q, self.W_K, self.W_V), biases))

    def projection_inputs(self) -> tuple[ProjectionInput, ...]:
        """The input points of the projections this layer has, q's first (fewer in probe.shared_attention's)."""
        return tuple(getattr(self, name) for name, own in zip("qkv", (True, *self.projects)) if own)

    def _gate_logits(self, x: Union[torch.Tensor, PerHeadInputs]) -> torch.Tensor:
        """[batch pos head d_head] (or [... head 1]: a gate per head), from the queries' input (each head's own, where
        heads have their own inputs)."""
        if isinstance(x, torch.Tensor):
            return rearrange(self.gate(x), "batch pos (head width) -> batch pos head width", width=self.gate_width)
        w = rearrange(self.gate.weight, "(head width) d_model -> head d_model width", width=self.gate_width)
        out = einsum(x.q, w, "batch pos head d_model, head d_model width -> batch pos head width")
        return out if self.gate.bias is None else out + self.gate.bias.view(-1, self.gate_width)

    def _attend_explicitly(self, q, k, v, allowed, bias):
        scores = einsum(q, k, "batch query_pos head d_head, batch key_pos head d_head -> batch head query_pos key_pos")
        scores = self.score_cap(scores * self.scale)
        if bias is not None:
            scores = scores + bias
        allowed = visible_keys(allowed, self.causal, q.shape[1], q.device)
        scores = self.hook_attn_scores(scores if allowed is None else scores.masked_fill(~allowed, self.masked_score))
        pattern = self.hook_pattern(attention_softmax(scores, self.sinks))
        return einsum(pattern, v, "batch head query_pos key_pos, batch key_pos head d_head -> batch query_pos head d_head")

    # Per-head views of the weights, in the shapes interpretability code expects.
    def _split_qkv_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv.weight.split(self.qkv_sizes, dim=0)

    @weight_view
    def W_Q(self) -> torch.Tensor:  # [head d_model d_head]
        return rearrange(self._split_qkv_weight()[0], "(head d_head) d_model -> head d_model d_head", d_head=self.d_head)

    @weight_view
    def W_K(self) -> torch.Tensor:  # [kv_head d_model d_head]
        return rearrange(self._split_qkv_weight()[1], "(head d_head) d_model -> head d_model d_head", d_head=self.d_head)

    @weight_view
    def W_V(self) -> torch.Tensor:  # [kv_head d_model d_head]
        return rearrange(self._split_qkv_weight()[2], "(head d_head) d_model -> head d_model d_head", d_head=self.d_head)

    @weight_view
    def W_O(self) -> torch.Tensor:  # [head d_head d_model]
        return self.out.weight.t().unflatten(0, (-1, self.d_head))  # a view, as rearrange's, without its parsing

    @property
    def OV(self) -> FactoredMatrix:  # [head d_model d_model]: W_V @ W_O, a key/value head repeated per query head
        return FactoredMatrix(self.W_V.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0), self.W_O)

    @property
    def QK(self) -> FactoredMatrix:  # [head d_model d_model]: W_Q @ W_K^T, before the scale, rotary and biases
        return FactoredMatrix(self.W_Q, self.W_K.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0).mT)

    @bias_view(lambda attn: attn.out.weight.shape[:1])
    def b_O(self) -> torch.Tensor:  # [d_model], zeros without an output bias (out.bias is None)
        return self.out.bias

    def _qkv_bias(self, part: int) -> Optional[torch.Tensor]:
        """Part 0, 1 or 2 (q, k, v) of the fused bias as [head d_head]; None without q/k/v biases."""
        if self.qkv.bias is None:
            return None
        return self.qkv.bias.split(self.qkv_sizes)[part].view(-1, self.d_head)

    @bias_view(lambda attn: (attn.n_heads, attn.d_head))
    def b_Q(self) -> torch.Tensor:  # [head d_head], zeros without q/k/v biases (qkv.bias is None)
        return self._qkv_bias(0)

    @bias_view(lambda attn: (attn.n_kv_heads, attn.d_head))
    def b_K(self) -> torch.Tensor:  # [kv_head d_head]
        return self._qkv_bias(1)

    @bias_view(lambda attn: (attn.n_kv_heads, attn.d_head))
    def b_V(self) -> torch.Tensor:  # [kv_head d_head]
        return self._qkv_bias(2)
