"""A sparse mixture of experts in place of a layer's MLP (Mixtral, OLMoE, Qwen-MoE, GPT-OSS, DeepSeek, GLM-4.5), in
transformer-lens 3's layout and names.

The router (`mlp.W_gate`, an nn.Linear as TL names it) scores every expert for each token: the softmax over the
experts' logits, or (DeepSeek-V3, GLM-4.5) the sigmoid of each. The `per_token` experts with the largest scores run on
that token (with DeepSeek's selection bias, `mlp.e_score_correction_bias`, added to the scores for the choice alone,
and the choice limited to the best groups of experts where the config groups them), and their outputs are summed
with their scores as weights (renormalised to sum to 1 where the config says, then times its scaling factor). Beside
them a shared expert every token runs, `mlp.shared_expert`, a gated MLP with its points, added as it is (DeepSeek,
GLM-4.5) or (Qwen2-MoE) times a sigmoid gate, `hook_shared_expert_gate`.

The routing points hold every token of the batch in one row each, as TL's do: `hook_expert_weights` [batch*pos
experts], the scores over every expert before the choice, in float32 (the softmax, or each expert's sigmoid before
the selection bias: the weights are read from it, and an edit there changes which experts run; GPT-OSS chooses by
logit first and holds the softmax over the chosen ones, zeros elsewhere), and `hook_expert_indices` [batch*pos
per_token], the chosen experts, the best choice score first. Each expert's points (`mlp.experts.{e}.hook_gate`,
`hook_pre`, `hook_post`) hold only the rows routed to it, [routed d_mlp]: the tokens that chose it first, then those
that chose it second, as TL orders them.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from probe.activations import ACTIVATIONS
from probe.config import DecoderConfig
from probe.config_choices import ClampedSwiGLU
from probe.hooks import HookPoint
from probe.mlp import MLP, GatedMLP, make_dense_mlp


class GLU(nn.Module):
    """act(gate) * up."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedGLU(nn.Module):
    """GPT-OSS's: the gate clamped above and the up projection both ways at `limit`, then (up + 1) * g * sigmoid(alpha
    * g) (the clamps bound what a few huge pre-activations can write)."""

    def __init__(self, spec: ClampedSwiGLU):
        super().__init__()
        self.alpha, self.limit = spec.alpha, spec.limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class OutputBias(nn.Module):
    """x + bias [d]: a bias added once after a weighted sum of experts' writes (JetMoE's MLP and attention experts)."""

    def __init__(self, d: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Expert(nn.Module):
    """One expert: W_out(glu(W_gate x, W_in x)), transformer-lens's MoEGatedMLP (nn.Linear layers under its names; with
    GPT-OSS's clamped GLU, its GptOssExpert)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        # W_in is the up projection; built and registered in TL's order, which a HookedTransformerConfig model's
        # draws follow
        for name, shape in expert_projections(cfg):
            setattr(self, name, nn.Linear(*shape, bias=routed_biased(cfg)))
        clamped = cfg.experts.clamped_glu
        self.glu = GLU(ACTIVATIONS[cfg.activation]()) if clamped is None else ClampedGLU(clamped)
        self.hook_gate = HookPoint()  # [routed d_mlp]: the gate's pre-activation
        self.hook_pre = HookPoint()  # [routed d_mlp]: the up projection
        self.hook_post = HookPoint()  # [routed d_mlp]: glu(gate, up), what W_out reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [routed d_model] -> [routed d_model]
        gate, up = self.hook_gate(self.W_gate(x)), self.hook_pre(self.W_in(x))
        return self.W_out(self.hook_post(self.glu(gate, up)))


class PlainExpert(nn.Module):
    """One ungated expert: W_out(act(W_in x)) (NemotronH's relu^2 experts), nn.Linear layers under TL's names."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        for name, shape in expert_projections(cfg):
            setattr(self, name, nn.Linear(*shape, bias=routed_biased(cfg)))
        self.act_fn = ACTIVATIONS[cfg.activation]()
        self.hook_pre = HookPoint()  # [routed d_mlp]: the up projection
        self.hook_post = HookPoint()  # [routed d_mlp]: act(up), what W_out reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [routed d_in] -> [routed d_in]
        return self.W_out(self.hook_post(self.act_fn(self.hook_pre(self.W_in(x)))))


class MoEMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        experts = cfg.experts
        self.per_token, self.scaling = experts.per_token, experts.scaling
        # the chosen experts' weights as they are, or divided by their sum (plus a small eps, or clamped below: ERNIE's)
        self.normalize = as_is if not experts.renormalize else (
            functools.partial(over_sum, eps=experts.renormalize_eps) if experts.renormalize_min is None else
            functools.partial(over_clamped_sum, floor=experts.renormalize_min))
        self.route = {"all": self._score_then_choose, "chosen": self._choose_then_softmax,
                      "sparsemixer": self._sparsemixer}[experts.softmax_over]
        self.sparsemixer_eps = experts.sparsemixer_eps
        self.weigh = weigh_input if experts.scale_inputs else weigh_output  # (Llama 4's weights scale the input)
        self.score = SCORES[experts.scoring]
        self.cap_logits = as_is if experts.router_softcap is None else functools.partial(capped, cap=experts.router_softcap)
        self.groups = experts.groups
        # what the choice reads: the scores, plus the selection bias where there is one, within the kept groups
        self.limit_to_groups = as_is if experts.groups is None else self.best_groups_only
        self.group_score = None if experts.groups is None else GROUP_SCORES[experts.groups.score]
        self.bias_choice = self._plus_selection_bias if experts.selection_bias else as_is
        # (the experts registered before the router, as TL registers them: HookedTransformerConfig models draw their
        # weights in that order)
        self.experts = nn.ModuleList((Expert if experts.gated else PlainExpert)(cfg) for _ in range(experts.n))
        # NemotronH's latent experts read a projection of the residual and write back through another (the router
        # reads the residual itself); without one, both are identities
        self.into_routed = self.out_of_routed = as_is
        if experts.output_bias:  # JetMoE's: one bias after the weighted sum, whichever experts ran
            self.out_bias = OutputBias(cfg.d_model)
            self.out_of_routed = self._plus_output_bias  # (a method: the module itself would register twice)
        if experts.latent is not None:
            self.fc1_latent_proj = nn.Linear(cfg.d_model, experts.latent, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(experts.latent, cfg.d_model, bias=cfg.mlp_bias)
            self.into_routed, self.out_of_routed = self._into_latent, self._out_of_latent
        self.W_gate = nn.Linear(cfg.d_model, experts.n, bias=routed_biased(cfg))  # the router
        if experts.selection_bias:  # [experts], float32: learned by a balancing rule, not by gradients (a buffer)
            self.register_buffer("e_score_correction_bias", torch.zeros(experts.n, dtype=torch.float32))
        # [batch*pos experts]: the scores (softmax, or each expert's sigmoid) in float32, before any selection bias
        # (softmax_over="chosen": the chosen experts' weights, 0 for the others)
        self.hook_expert_weights = HookPoint()
        self.hook_expert_indices = HookPoint()  # [batch*pos per_token]: the chosen experts, the best choice first
        self.add_shared = self._routed_alone
        if experts.shared is not None:  # an MLP every token runs (gated, as the experts are)
            self.shared_expert = (GatedMLP if experts.gated else MLP)(dataclasses.replace(cfg, d_mlp=experts.shared,
                                                                                          experts=None))
            self.add_shared = self._plus_shared
        if experts.shared is not None and experts.shared_gate:  # Qwen2-MoE: weighed by a sigmoid gate of its own
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=cfg.mlp_bias)
            self.hook_shared_expert_gate = HookPoint()  # [batch*pos 1]: the sigmoid the shared expert's output is times
            self.add_shared = self._plus_gated_shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos d_model]
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(self.cap_logits(self.W_gate(tokens)))
        routed_in = self.into_routed(tokens)  # [batch*pos d_in]: the residual, or its latent projection
        out = self.weighted_experts(routed_in, weights, chosen)
        return self.add_shared(tokens, self.out_of_routed(out)).view(x.shape)

    def weighted_experts(self, routed_in: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """[tokens d_in]: each token's chosen experts' outputs on `routed_in` [tokens d_in], times their `weights`
        [tokens per_token] (`chosen`: hook_expert_indices; Experts.scale_inputs: on their inputs times them), summed."""
        out = torch.zeros_like(routed_in)
        for index, expert in enumerate(self.experts):
            slot, rows = self.routing(chosen, index)
            weight = weights[rows, slot, None].to(routed_in.dtype)
            out = out.index_add(0, rows, self.weigh(expert, routed_in[rows], weight))
        return out

    def _into_latent(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc1_latent_proj(tokens)

    def _out_of_latent(self, routed: torch.Tensor) -> torch.Tensor:
        return self.fc2_latent_proj(routed)

    def _plus_output_bias(self, routed: torch.Tensor) -> torch.Tensor:
        return self.out_bias(routed)

    def residual_readers(self) -> list[nn.Module]:
        """The layers that read the MLP's input (ln2's output): the router, the shared expert's, and the experts' own
        (or the latent projection they read)."""
        shared = [] if not hasattr(self, "shared_expert") else [self.shared_expert.fc_in] + (
            [self.shared_expert.gate] if hasattr(self.shared_expert, "gate") else [])
        shared += [self.shared_expert_gate] if hasattr(self, "shared_expert_gate") else []
        if hasattr(self, "fc1_latent_proj"):
            return [self.W_gate] + shared + [self.fc1_latent_proj]
        return [self.W_gate] + shared + [layer for expert in self.experts for layer in (
            [expert.W_in] + ([expert.W_gate] if hasattr(expert, "W_gate") else []))]

    def residual_writers(self) -> list[nn.Module]:
        """The layers whose outputs the residual stream receives: every expert's W_out (or the latent projection
        back), the shared expert's."""
        routed = [self.fc2_latent_proj] if hasattr(self, "fc2_latent_proj") else [e.W_out for e in self.experts]
        return routed + ([self.shared_expert.fc_out] if hasattr(self, "shared_expert") else [])

    def _apply(self, fn, recurse=True):
        # the selection bias follows a move, not a cast: transformers keeps it in float32 whatever the model's dtype,
        # and DeepSeek-V3's experts' biases differ in digits bfloat16 drops
        bias = getattr(self, "e_score_correction_bias", None)
        exact = None if bias is None or bias.is_meta else bias.float()
        super()._apply(fn, recurse)
        if exact is not None:
            self.e_score_correction_bias = exact.to(self.e_score_correction_bias.device)
        return self

    def _routed_alone(self, tokens: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed

    def _plus_shared(self, tokens: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed + self.shared_expert(tokens)

    def _plus_gated_shared(self, tokens: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        gate = self.hook_shared_expert_gate(torch.sigmoid(self.shared_expert_gate(tokens)))
        return routed + gate * self.shared_expert(tokens)

    def _score_then_choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen) [batch*pos per_token]: every expert scored, the best `per_token` by choice score (the
        score, plus the selection bias, within the kept groups), weighted by their scores (Mixtral, OLMoE, Qwen-MoE,
        DeepSeek, GLM-4.5); an edit at hook_expert_weights changes which experts run. As TL 3.9's MoE, the weights are
        read at the choice, before hook_expert_indices: an edit there reroutes a token with the same weights."""
        scores = self.hook_expert_weights(self.score(logits))
        chosen = self.limit_to_groups(self.bias_choice(scores)).topk(self.per_token, dim=-1).indices
        weights = self.normalize(scores.gather(1, chosen))
        return weights * self.scaling, self.hook_expert_indices(chosen)

    def _plus_selection_bias(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.e_score_correction_bias

    def best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """[batch*pos experts] choice scores with -inf at every expert outside each token's `kept` best groups of
        adjacent experts (a group scored by its two best choice scores' sum, or its best)."""
        grouped = choice.view(choice.shape[0], self.groups.n, -1)  # [batch*pos group expert_in_group]
        kept = self.group_score(grouped).topk(self.groups.kept, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter(1, kept, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def _choose_then_softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest logits chosen, then the softmax over them (GPT-OSS), as transformer-lens's GptOssMoE: the
        weights read at the (hooked) chosen experts from the (hooked) weights."""
        return choose_then_softmax(logits, self.per_token, self.hook_expert_weights, self.hook_expert_indices)

    def _sparsemixer(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PhiMoE's routing at inference (transformers' sparsemixer, training=False), in float32: the expert of the
        largest logit, weighted by the softmax over the experts near it (near_softmax), then the largest of the
        others, weighted by the softmax over the experts near it but the first. As softmax_over="chosen", the (hooked)
        weights hold the two at the chosen experts and 0 elsewhere, and are read at the (hooked) choice."""
        scores = logits.float()
        first = scores.argmax(dim=-1, keepdim=True)  # [batch*pos 1]
        first_weight = near_softmax(scores, scores, scores.gather(1, first), self.sparsemixer_eps).gather(1, first)
        others = scores.scatter(1, first, float("-inf"))
        second = others.argmax(dim=-1, keepdim=True)
        second_weight = near_softmax(others, scores, others.gather(1, second), self.sparsemixer_eps).gather(1, second)
        chosen = torch.cat([first, second], dim=-1)  # [batch*pos 2]
        probs = self.hook_expert_weights(torch.zeros_like(scores).scatter(1, chosen, torch.cat([first_weight,
                                                                                                 second_weight], -1)))
        chosen = self.hook_expert_indices(chosen)
        return probs.gather(1, chosen), chosen

    @staticmethod
    def routing(chosen: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, row) of each token row (of batch*pos) that expert `index` runs on, from hook_expert_indices `chosen`,
        in the order its points hold them: the tokens that chose it first, then second, ..., as transformer-lens."""
        return torch.where((chosen == index).T)


def choose_then_softmax(logits: torch.Tensor, per_token: int, weights_point: nn.Module,
                        indices_point: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [batch*pos per_token], chosen) from router `logits` [batch*pos experts]: the `per_token` largest
    chosen, weighted by the softmax over their logits in float32 (GPT-OSS's experts, JetMoE's experts and attention
    experts); `weights_point` holds those weights at the chosen experts, zeros elsewhere, and the weights are read
    from it at `indices_point`'s choice."""
    top, chosen = logits.topk(per_token, dim=-1)
    probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, chosen, F.softmax(top, dim=-1, dtype=torch.float32))
    probs = weights_point(probs)
    chosen = indices_point(chosen)
    return probs.gather(1, chosen), chosen


def weigh_output(expert: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [routed d_in]
    return expert(x) * weight


def weigh_input(expert: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [routed d_in]
    return expert(x * weight)


def as_is(scores: torch.Tensor) -> torch.Tensor:
    return scores


def near_softmax(candidates: torch.Tensor, scores: torch.Tensor, top: torch.Tensor, eps: float) -> torch.Tensor:
    """[batch*pos experts]: the softmax over `candidates` (the logits, -inf where an expert is already chosen) of the
    experts whose logit lies within a relative 2 * eps of `top` [batch*pos 1], (top - logit) / max(|logit|, top) <=
    2 eps, the rest masked out (sparsemixer's mask, read off the unmasked `scores`, as transformers reads it)."""
    far = (top - scores) / scores.abs().clamp(min=top) > 2 * eps
    return F.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)


def over_sum(weights: torch.Tensor, eps: float = 1e-20) -> torch.Tensor:  # [batch*pos per_token]
    # (eps: an edit that zeroes the chosen scores leaves zeros, not NaN, as DeepSeek-V3's 1e-20; LFM2-MoE's is 1e-6)
    return weights / (weights.sum(dim=-1, keepdim=True) + eps)


def over_clamped_sum(weights: torch.Tensor, floor: float) -> torch.Tensor:  # [batch*pos per_token]
    # ERNIE 4.5's: a sum below the floor (moe_norm_min) divides as the floor
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=floor)


def routed_biased(cfg: DecoderConfig) -> bool:
    """Whether the router and the routed experts have biases: where the MLPs have them (cfg.mlp_bias), unless the
    experts say not (Experts.routed_bias: ERNIE 4.5's biases reach its dense and shared MLPs alone)."""
    return cfg.mlp_bias and cfg.experts.routed_bias


def softmax_scores(logits: torch.Tensor) -> torch.Tensor:  # [batch*pos experts], float32
    return F.softmax(logits, dim=-1, dtype=torch.float32)


def sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:  # [batch*pos experts], float32
    return logits.float().sigmoid()


def capped(logits: torch.Tensor, cap: float) -> torch.Tensor:  # [batch*pos experts], float32 (Laguna's router)
    return torch.tanh(logits.float() / cap) * cap


def top2_sum(grouped: torch.Tensor) -> torch.Tensor:  # [batch*pos group expert_in_group] -> [batch*pos group]
    return grouped.topk(2, dim=-1).values.sum(dim=-1)


def best(grouped: torch.Tensor) -> torch.Tensor:  # [batch*pos group expert_in_group] -> [batch*pos group]
    return grouped.amax(dim=-1)


SCORES = {"softmax": softmax_scores, "sigmoid": sigmoid_scores}  # Experts.scoring -> the scoring
GROUP_SCORES = {"top2_sum": top2_sum, "max": best}  # ExpertGroups.score -> a group's score


def expert_projections(cfg: DecoderConfig) -> list[tuple[str, tuple[int, int]]]:
    """(name, (in, out)) of an expert's projections in the order transformer-lens builds them: W_in, W_out, W_gate
    (its MoEGatedMLP), or W_gate, W_in, W_out (its GptOssExpert), or (ungated) W_in, W_out; each cfg.expert_width
    wide, reading and writing experts.latent wide vectors where the experts are latent."""
    d, m = cfg.experts.latent or cfg.d_model, cfg.expert_width
    shapes = {"W_gate": (d, m), "W_in": (d, m), "W_out": (m, d)}
    if not cfg.experts.gated:
        return [("W_in", shapes["W_in"]), ("W_out", shapes["W_out"])]
    order = ("W_in", "W_out", "W_gate") if cfg.experts.clamped_glu is None else ("W_gate", "W_in", "W_out")
    return [(name, shapes[name]) for name in order]


def draw_as_transformer_lens_builds(cfg: DecoderConfig) -> None:
    """Draw from torch's generator what building transformer-lens's experts draws (each nn.Linear initialises itself
    as it is made: the experts, then the router, layer by layer), so a model from HookedTransformerConfig leaves the
    generator where TL's leaves it. Nothing for a model without experts (TL's other modules start empty)."""
    if cfg.experts is None:
        return
    linears = [shape for _, shape in expert_projections(cfg)] * cfg.experts.n + [(cfg.d_model, cfg.experts.n)]
    dtype = None if cfg.experts.clamped_glu is None else cfg.dtype  # (only TL's GPT-OSS layers take the config's)
    for _ in filter(cfg.layer_sparse, range(cfg.n_layers)):
        for d_in, d_out in linears:
            torch.empty(d_out, d_in, dtype=dtype).uniform_()
            if routed_biased(cfg):
                torch.empty(d_out, dtype=dtype).uniform_()


def make_mlp(cfg: DecoderConfig, layer: int) -> nn.Module:
    """`layer`'s MLP: a mixture of experts where the config has one there, else one MLP of d_mlp."""
    return MoEMLP(cfg) if cfg.layer_sparse(layer) else make_dense_mlp(cfg)
