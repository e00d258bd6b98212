"""A mixture of attention heads (JetMoE's MoA, Shen et al. 2024; transformers' JetMoeAttention with its JetMoeMoA),
every intermediate hooked.

    logits = W_gate x                              [batch*pos experts]: the router
    chosen, w = the per_token largest logits, the softmax over them (float32)
    q[slot] = W_Q[chosen[slot]] x                  the chosen expert's queries, n_kv_heads heads of d_head
    k, v = W_K x, W_V x                            one key/value projection for every expert (the file's kv_proj)
    z[slot, h] = softmax(q[slot, h] . k[h] / sqrt(d_head)) v[h]     rotary on q and k, causal
    out = sum over slots of w[slot] * W_O[chosen[slot]] z[slot], plus b_O

The heads are the chosen slots': head slot * n_kv_heads + h reads key/value head h with the queries of the expert the
token chose in that slot, the best first (transformers' order, and TL 4's bridge's hook_pattern), so n_heads =
per_token * n_kv_heads and a head's weights change with the token's choice. hook_expert_indices [batch*pos per_token]
says which expert each slot ran; hook_expert_weights [batch*pos experts] holds the chosen experts' weights, zeros
elsewhere (read at the hooked choice: an edit there reroutes). hook_z is each slot head's z before its weight;
hook_result (opt-in) each slot head's write, its weight applied, so the heads' results and b_O sum to the layer's
output. No head has fixed query or output weights: W_Q, W_O, QK and OV are refused; the experts' own are
q_experts.weight [experts (kv_head d_head) d_model] and out_experts.weight [experts d_model (kv_head d_head)], as the
file holds them."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from probe.attention import attention_softmax, visible_keys
from probe.config import DecoderConfig
from probe.hooks import HookPoint, observed
from probe.kv_cache import LayerKV
from probe.moe import MoEMLP, OutputBias, choose_then_softmax
from probe.rotary import make_rotary
from probe.tl_weights import WritableWeights, bias_view, weight_view


class ExpertProjections(nn.Module):
    """One linear map per expert, weight [experts d_out d_in] (transformers' JetMoeParallelExperts); no bias (fold_ln
    scales its weight's last axis as any reader's)."""

    def __init__(self, experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d_out, d_in))
        self.bias = None

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[tokens slot d_out]: each token's input x [tokens d_in] (or [tokens slot d_in], one per slot) through the
        expert it chose in each slot (`chosen` [tokens slot]), times `weights` [tokens slot] where given."""
        out = x.new_zeros(*chosen.shape, self.weight.shape[1])
        for expert in range(self.weight.shape[0]):
            slot, rows = MoEMLP.routing(chosen, expert)
            routed = F.linear(x[rows] if x.dim() == 2 else x[rows, slot], self.weight[expert])
            out = out.index_put((rows, slot), routed if weights is None else routed * weights[rows, slot, None])
        return out


class MixtureOfAttention(WritableWeights, nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        spec = cfg.mixture_of_attention
        self.n_experts, self.per_token = spec.n, spec.per_token
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.window, self.n_ctx = None, cfg.n_ctx
        width = self.n_kv_heads * self.d_head
        self.W_gate = nn.Linear(cfg.d_model, spec.n, bias=False)  # the router, as MoEMLP's
        self.q_experts = ExpertProjections(spec.n, cfg.d_model, width)
        self.kv = nn.Linear(cfg.d_model, 2 * width, bias=False)  # keys' rows, then values'
        self.out_experts = ExpertProjections(spec.n, width, cfg.d_model)
        self.out_bias = OutputBias(cfg.d_model)  # (the file's experts.bias: b_O)
        self.scale = self.d_head ** -0.5
        self.rotary = make_rotary(cfg, layer)
        self.masked_score = float("-inf")
        self.hook_expert_weights = HookPoint()  # [batch*pos experts]: the chosen experts' weights, zeros elsewhere
        self.hook_expert_indices = HookPoint()  # [batch*pos per_token]: each slot's expert, the best first
        self.hook_q = HookPoint()  # [batch pos head d_head]: head = slot * n_kv_heads + kv_head
        self.hook_k = HookPoint()  # [batch pos kv_head d_head]
        self.hook_v = HookPoint()  # [batch pos kv_head d_head]
        self.hook_rot_q = HookPoint()  # [batch pos head d_head]
        self.hook_rot_k = HookPoint()  # [batch pos kv_head d_head]
        self.hook_attn_scores = HookPoint()  # [batch head query_pos key_pos]: scaled, masked, pre-softmax
        self.hook_pattern = HookPoint()  # [batch head query_pos key_pos]
        self.hook_z = HookPoint()  # [batch pos head d_head]: pattern-weighted values, before the slot's weight
        self.hook_result = HookPoint(opt_in=True)  # [batch pos head d_model]: each slot head's weighted write, no b_O

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None, allowed: Optional[torch.Tensor] = None,
                past: Optional[LayerKV] = None, qk_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As probe.attention.Attention's forward, on x [batch pos d_model] alone."""
        if not isinstance(x, torch.Tensor):
            raise ValueError("a mixture of attention heads routes each token's one input to its experts, so its heads "
                             "cannot read inputs of their own: unhook hook_attn_in / hook_q_input / hook_k_input / "
                             "hook_v_input (and set_use_split_qkv_input(False)); hook ln1's output instead")
        batch, pos, d_model = x.shape
        tokens = x.reshape(-1, d_model)
        weights, chosen = choose_then_softmax(self.W_gate(tokens), self.per_token, self.hook_expert_weights,
                                              self.hook_expert_indices)
        q = self.hook_q(self.q_experts(tokens, chosen).view(batch, pos, self.n_heads, self.d_head))
        kv = self.kv(x)
        n = self.n_kv_heads * self.d_head
        # slices, not split(): a hook may edit one in place, as in probe.attention
        k, v = (rearrange(t, "batch pos (head d_head) -> batch pos head d_head", d_head=self.d_head)
                for t in (kv[..., :n], kv[..., n:]))
        k, v = self.hook_k(k), self.hook_v(v)
        if self.rotary is not None:
            q, k = self.hook_rot_q(self.rotary(q, positions)), self.hook_rot_k(self.rotary(k, positions))
        if past is not None:
            k, v, _ = past.append(k, v, None)
        z = self.hook_z(self.attend(q, k, v, allowed))
        z = z.reshape(batch * pos, self.per_token, n)
        weights = weights.to(x.dtype)
        if observed(self.hook_result):
            out = self.hook_result(self.results(z, weights, chosen).view(batch, pos, self.n_heads, d_model)).sum(2)
        else:
            out = self.out_experts(z, chosen, weights).sum(1).view(batch, pos, d_model)
        return self.out_bias(out)

    def attend(self, q, k, v, allowed) -> torch.Tensor:
        """z [batch pos head d_head] from the rotated queries and every key and value seen [batch key_pos kv_head
        d_head], each slot's heads over the same keys (tiled, not interleaved: head slot * n_kv_heads + h reads h)."""
        k, v = (t.repeat(1, 1, self.per_token, 1) for t in (k, v))
        if observed(self.hook_attn_scores) or observed(self.hook_pattern):
            scores = einsum(q, k, "batch query_pos head d_head, batch key_pos head d_head -> batch head query_pos key_pos")
            visible = visible_keys(allowed, True, q.shape[1], q.device)
            scores = self.hook_attn_scores((scores * self.scale).masked_fill(~visible, self.masked_score))
            pattern = self.hook_pattern(attention_softmax(scores, None))
            return einsum(pattern, v, "batch head query_pos key_pos, batch key_pos head d_head -> batch query_pos head d_head")
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                                              is_causal=allowed is None, scale=self.scale).transpose(1, 2)

    def results(self, z: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """[tokens head d_model]: each slot head's write, z [tokens slot (kv_head d_head)] through its slot's expert's
        output rows for that head, times the slot's weight."""
        out = z.new_zeros(z.shape[0], self.per_token, self.n_kv_heads, self.out_experts.weight.shape[1])
        per_head = rearrange(self.out_experts.weight, "expert d_model (head d_head) -> expert head d_head d_model",
                             d_head=self.d_head)
        for expert in range(self.n_experts):
            slot, rows = MoEMLP.routing(chosen, expert)
            zs = z[rows, slot].view(-1, self.n_kv_heads, self.d_head)
            written = einsum(zs, per_head[expert], "routed head d_head, head d_head d_model -> routed head d_model")
            out = out.index_put((rows, slot), written * weights[rows, slot, None, None])
        return out.flatten(1, 2)

    @property
    def hooked_kv_heads(self) -> int:
        """Keys and values are hooked once per key/value head (heads read no inputs of their own: forward refuses
        them)."""
        return self.n_kv_heads

    @hooked_kv_heads.setter
    def hooked_kv_heads(self, heads: int) -> None:
        if heads != self.n_kv_heads:
            raise ValueError("a mixture of attention heads computes its keys and values once for every slot's heads "
                             "(each slot its own expert's queries over them), so they cannot be hooked per query head: "
                             "keep ungroup_grouped_query_attention off")

    @property
    def readers(self) -> list[nn.Module]:
        """The layers that read the normed residual (what fold_ln folds ln1 into)."""
        return [self.W_gate, self.q_experts, self.kv]

    @bias_view(lambda attn: attn.out_bias.bias.shape)
    def b_O(self) -> torch.Tensor:  # [d_model]
        return self.out_bias.bias

    @weight_view
    def W_K(self) -> torch.Tensor:  # [kv_head d_model d_head]
        return rearrange(self.kv.weight[: self.n_kv_heads * self.d_head], "(head d_head) d_model -> head d_model d_head",
                         d_head=self.d_head)

    @weight_view
    def W_V(self) -> torch.Tensor:  # [kv_head d_model d_head]
        return rearrange(self.kv.weight[self.n_kv_heads * self.d_head:], "(head d_head) d_model -> head d_model d_head",
                         d_head=self.d_head)

    def __getattr__(self, name: str):
        if name in ("W_Q", "W_O", "b_Q", "b_K", "b_V", "QK", "OV", "qkv", "out"):
            raise AttributeError(f"a mixture of attention heads has no {name}: each head's query and output weights are "
                                 "those of the expert its token chose in that slot (hook_expert_indices); read "
                                 "q_experts.weight / out_experts.weight [experts ...] or the activations (hook_q, hook_z, "
                                 "hook_result)")
        return super().__getattr__(name)
