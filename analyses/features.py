"""A sparse autoencoder's features on a prompt, what each feature writes, and what the SAE costs the model.

An SAE (`probe.SparseAutoencoder`) reads the activation x at its hook point and writes it back as a
sparse sum of decoder rows, x_hat = sum_f a_f W_dec[f] + b_dec.

- `sae_features`: per position, the k most active features, L0 (how many are active) and the
  reconstruction's relative error ||x - x_hat||^2 / ||x - mean(x)||^2.
- `feature_logits`: the tokens each feature's decoder row promotes and suppresses when read through
  the final norm's weight and the unembedding, as `value_tokens(..., through_final_norm=True)` reads
  an FFN value.
- `sae_loss_recovered`: the next-token loss of the clean model, of the model running on the SAE's
  reconstruction, and of the model with the activation zeroed; recovered = (zero - spliced) / (zero - clean).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum, rearrange

from analyses.ablation import loss_metric
from analyses.common import AnalysisInput, PromotedTokens, escape_token, is_int, model_mask, token_decoder, tokens_and_mask, unit_ids
from analyses.memories import _final_norm_directions, _top_tokens, _value_directions
from hooks import HookPoint, UnknownNameError
from probe import HookedDecoder, SparseAutoencoder, spliced
from probe.shapes import hook_shapes

FeatureSpec = Union[int, Sequence[int], torch.Tensor]


# ---- checks --------------------------------------------------------------------------------------
def check_sae(model: HookedDecoder, sae: SparseAutoencoder) -> str:
    """The SAE's hook name, once checked to fit the model: a hook point it has, one activation vector per
    position of the SAE's width there, and no SAE spliced in at it right now. Before any work."""
    if not isinstance(sae, SparseAutoencoder):
        raise TypeError(f"sae must be a probe.SparseAutoencoder (e.g. SparseAutoencoder.from_pretrained(directory)), "
                        f"got {type(sae).__name__}")
    name = sae.cfg.hook_name
    try:
        model.hook_point(name)
    except UnknownNameError as err:
        raise UnknownNameError(f"the SAE reads {name!r}, a hook point this model lacks (an SAE for another model?): "
                               f"{err}") from None
    if f"{name}.hook_sae_input" in model.hook_names:
        # the point then holds an SAE's output: features of a reconstruction, and a second splice would collide
        raise ValueError(f"an SAE is spliced into the model at {name!r} right now; call this outside the "
                         "`with spliced(...)` block (it runs the model with and without the SAE itself)")
    shape = hook_shapes(model.cfg, 1, 1).get(name)  # for one position; an SAE on hook_z reads the heads flattened
    heads_flattened = name.endswith("hook_z")
    if shape is not None and (shape[:2] != (1, 1) or (len(shape) != 3 and not heads_flattened)):
        raise ValueError(f"the SAE reads one activation vector per position, but {name!r} is not one (its shape is "
                         f"[batch {' '.join(map(str, shape[1:]))}] for one position): an SAE for another hook point")
    if shape is not None and math.prod(shape[2:]) != sae.cfg.d_in:  # one vector per position: its size
        raise ValueError(f"the SAE reads {sae.cfg.d_in} dimensions, but the activation at {name!r} has "
                         f"{math.prod(shape[2:])}: it was trained for another model or hook point")
    return name


def _check_k(k, limit: int, what: str) -> int:
    if not is_int(k) or not 0 < int(k) <= limit:
        raise ValueError(f"k={k!r} must be an integer in [1, {what}={limit}]")
    return int(k)


def feature_ids(sae: SparseAutoencoder, features: FeatureSpec) -> torch.Tensor:
    """[feature] int64 on the CPU, each checked to be one of the SAE's features, none twice."""
    return unit_ids(features, sae.cfg.d_sae, "feature", f"the SAE's features [0, d_sae={sae.cfg.d_sae})")


# ---- sae_features --------------------------------------------------------------------------------
@dataclass
class SAEFeatures:
    """The SAE's features on a batch of prompts; dimensions `batch pos k`, padding marked by `mask`."""

    hook_name: str
    tokens: torch.Tensor  # [batch pos]
    mask: torch.Tensor  # [batch pos] bool: real tokens
    token_strings: list[list[str]]  # [batch][pos]: each token's raw string (escape before HTML)
    top_ids: torch.Tensor  # [batch pos k] int64, most active first; -1 past the active ones and at padding
    top_activations: torch.Tensor  # [batch pos k] float32; 0 where top_ids is -1
    l0: torch.Tensor  # [batch pos] int64: active features (0 at padding)
    fvu: torch.Tensor  # [batch pos] float32: ||x - x_hat||^2 / ||x - mean(x)||^2, mean over x's d_in entries; NaN at padding
    feature_ids: torch.Tensor  # [feature]: every feature in some real position's top k, ascending
    feature_activations: torch.Tensor  # [batch pos feature] float32: those features' activations everywhere (0 at padding)

    @property
    def k(self) -> int:
        return self.top_ids.shape[-1]

    def to_frame(self) -> pd.DataFrame:
        """One row per (prompt, real position, rank) of an active feature, with the position's L0 and fvu.
        A position where no feature is active keeps one row, its rank and feature empty."""
        rows = []
        for b, p in self.mask.nonzero().tolist():
            base = (b, p, self.token_strings[b][p])
            stats = (int(self.l0[b, p]), float(self.fvu[b, p]))
            active = [r for r in range(self.k) if int(self.top_ids[b, p, r]) >= 0]
            for r in active:
                rows.append(base + (r, int(self.top_ids[b, p, r]), float(self.top_activations[b, p, r])) + stats)
            if not active:
                rows.append(base + (None, None, float("nan")) + stats)
        frame = pd.DataFrame(rows, columns=["prompt", "position", "token", "rank", "feature", "activation", "l0", "fvu"])
        return frame.astype({"rank": "Int64", "feature": "Int64"})

    def figure(self, prompt: int = 0, max_features: Optional[int] = None) -> go.Figure:
        """Heatmap of one prompt: its real positions (rows) x the features in their top k (columns), each
        cell the feature's activation there; columns ordered by their largest activation, the first
        `max_features` of them (None = all)."""
        if not is_int(prompt) or not 0 <= prompt < self.tokens.shape[0]:
            raise ValueError(f"prompt={prompt!r} is outside the batch of {self.tokens.shape[0]}")
        if max_features is not None and (not is_int(max_features) or max_features < 1):
            raise ValueError(f"max_features={max_features!r} must be a positive integer, or None for all")
        positions = self.mask[prompt].nonzero().flatten()
        ids = self.top_ids[prompt, positions]
        mine = torch.isin(self.feature_ids, ids[ids >= 0])  # this prompt's features, among the batch's
        acts = self.feature_activations[prompt][positions][:, mine]  # [pos feature]
        order = acts.amax(0).argsort(descending=True)[:max_features]
        acts, features = acts[:, order], self.feature_ids[mine][order]
        labels = [f"{escape_token(self.token_strings[prompt][p])} ({p})" for p in positions.tolist()]
        stats = [[f"L0 {int(self.l0[prompt, p])}, fvu {float(self.fvu[prompt, p]):.3g}"] * len(features)
                 for p in positions.tolist()]
        fig = go.Figure(go.Heatmap(
            z=acts.tolist(), x=[f"F{f}" for f in features.tolist()], y=labels, customdata=stats,
            colorscale="Blues", zmin=0, colorbar=dict(title="activation"),
            hovertemplate="%{y}<br>feature %{x}: %{z:.4g}<br>%{customdata}<extra></extra>",
        ))
        fig.update_yaxes(autorange="reversed", type="category")
        fig.update_xaxes(type="category")
        shown = f"top {len(features)} of {int(mine.sum())}" if len(features) < int(mine.sum()) else f"{len(features)}"
        fig.update_layout(title=f"SAE features at {escape_token(self.hook_name)}: {shown} features in some position's "
                                f"top {self.k}", xaxis_title="feature", height=200 + 22 * len(labels))
        return fig


@torch.no_grad()
def sae_features(
    model: HookedDecoder,
    sae: SparseAutoencoder,
    input: AnalysisInput,
    k: int = 10,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> SAEFeatures:
    """The SAE's features at every real position of `input`: the k most active (fewer where fewer are
    active), L0, and the reconstruction's relative squared error. One forward, caching only the SAE's hook."""
    name = check_sae(model, sae)
    k = _check_k(k, sae.cfg.d_sae, "d_sae")
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    _, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=name)
    x = cache[name].to(sae.W_enc.device)
    encoded = sae.encode(x)  # the SAE says it when x has the wrong width
    if tuple(encoded.shape[:-1]) != tuple(tokens.shape):
        raise ValueError(f"the SAE's features at {name!r} have shape {tuple(encoded.shape)}; sae_features reads one "
                         f"activation vector per position, [batch pos d_sae]")
    x_flat = x.reshape(*tokens.shape, -1).float()  # hook_z: [... head d_head] -> [... (head d_head)], as the SAE reads it
    error = (x_flat - sae.decode(encoded).float()).pow(2).sum(-1)
    spread = (x_flat - x_flat.mean(-1, keepdim=True)).pow(2).sum(-1)
    features = encoded.float()
    mask = mask.to(features.device)

    top = features.topk(k, dim=-1)
    shown = (top.values > 0) & mask[..., None]
    top_ids = torch.where(shown, top.indices, -1)
    chosen = top_ids[top_ids >= 0].unique()
    decode = token_decoder(model)
    return SAEFeatures(
        hook_name=name, tokens=tokens.cpu(), mask=mask.cpu(),
        token_strings=[decode(row) for row in tokens.tolist()],
        top_ids=top_ids.cpu(), top_activations=torch.where(shown, top.values, 0.0).cpu(),
        l0=((features > 0) & mask[..., None]).sum(-1).cpu(),
        fvu=torch.where(mask, error / spread, float("nan")).cpu(),
        feature_ids=chosen.cpu(), feature_activations=(features[..., chosen] * mask[..., None]).cpu(),
    )


# ---- feature_logits ------------------------------------------------------------------------------
def _residual_write(model: HookedDecoder, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The linear map from directions at `name` [n width] to what they add to the residual stream [n d_model],
    float32. Found by the hook point's identity, not its name."""
    point = model.hook_point(name)
    for layer, block in enumerate(model.blocks):
        if point is block.attn.hook_z:
            W_O = block.attn.W_O.detach().float()  # [head d_head d_model]
            # a sandwich block's attention write is normalised: times ln1_post.w over a per-position scale
            post = block.ln1_post.w.detach().float() if hasattr(block, "ln1_post") else None

            def through_W_O(directions: torch.Tensor) -> torch.Tensor:
                heads = rearrange(directions, "n (head d_head) -> n head d_head", head=W_O.shape[0])
                written = einsum(heads, W_O, "n head d_head, head d_head d_model -> n d_model")
                return written if post is None else written * post

            return through_W_O
        if point is block.mlp.hook_post:
            values = _value_directions(model, layer, torch.arange(block.mlp.W_out.shape[0]), through_final_norm=False)
            return lambda directions: directions @ values  # [d_mlp d_model]: each neuron's write
    residual = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out",
                "hook_resid_post")
    if any(point is getattr(owner, attr, None) for owner in (model, *model.blocks) for attr in residual):
        return lambda directions: directions
    raise ValueError(
        f"feature_logits reads decoder rows as writes to the residual stream, and {name!r} is not one: it takes SAEs "
        "on the residual stream (hook_resid_pre/mid/post, hook_embed), the sublayer outputs (hook_attn_out, "
        "hook_mlp_out), attn.hook_z (read through W_O) and mlp.hook_post (read through W_out)"
    )


@dataclass
class FeatureLogits(PromotedTokens):
    """The tokens each feature's decoder row promotes and suppresses, read through the final norm and W_U."""

    hook_name: str
    features: torch.Tensor  # [feature]
    top_ids: torch.Tensor  # [feature k], most promoted first
    top_logits: torch.Tensor  # [feature k]
    bottom_ids: torch.Tensor  # [feature k], most suppressed first
    bottom_logits: torch.Tensor  # [feature k]
    token_strings: list[list[str]]  # [feature] of k promoted strings then k suppressed strings, raw

    def to_frame(self) -> pd.DataFrame:
        """One row per (feature, direction, rank): the token, its id and its logit."""
        return self._promoted_frame({"feature": self.features.tolist()})

    def figure(self, max_features: int = 20) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits, tokens written in the cells."""
        return self._promoted_figure([f"F{int(f)}" for f in self.features[:max_features]],
                                     f"Tokens promoted and suppressed by the decoder rows of the SAE at "
                                     f"{escape_token(self.hook_name)} (W_dec through the final norm and W_U)")


@torch.no_grad()
def feature_logits(model: HookedDecoder, sae: SparseAutoencoder, features: FeatureSpec, k: int = 10) -> FeatureLogits:
    """The top-k promoted and bottom-k suppressed tokens of each feature's decoder row W_dec[f], as it
    reaches the unembedding: through W_O (hook_z) or W_out (mlp.hook_post) into the residual stream,
    then centred (a LayerNorm final norm) and multiplied by the final norm's weight; in float32."""
    name = check_sae(model, sae)
    ids = feature_ids(sae, features)
    k = _check_k(k, model.cfg.d_vocab, "d_vocab")
    write = _residual_write(model, name)  # check_sae made sure the SAE's width is the activation's
    W_dec = sae.W_dec.detach()

    def directions(rows: slice) -> torch.Tensor:
        chosen = W_dec[ids[rows].to(W_dec.device)].to(model.device, torch.float32)
        return _final_norm_directions(model, write(chosen))

    top_logits, top_ids, bottom_logits, bottom_ids = _top_tokens(model, directions, len(ids), k)
    decode = token_decoder(model)
    strings = [decode(top_ids[i].tolist() + bottom_ids[i].tolist()) for i in range(len(ids))]
    return FeatureLogits(name, ids, top_ids, top_logits, bottom_ids, bottom_logits, strings)


# ---- sae_loss_recovered --------------------------------------------------------------------------
@dataclass
class SAELossRecovered:
    """Next-token cross-entropy per prompt (nats, mean over its predicted real tokens) three ways."""

    hook_name: str
    clean: torch.Tensor  # [batch]: the model as it is
    spliced: torch.Tensor  # [batch]: the SAE's reconstruction in place of the activation (no error term)
    zero_ablated: torch.Tensor  # [batch]: the activation set to zero

    @property
    def recovered(self) -> torch.Tensor:
        """[batch]: (zero - spliced) / (zero - clean), SAELens's CE loss score: 1 when the SAE costs
        nothing, 0 when it is as bad as zeroing; NaN where zeroing changes nothing."""
        gap = self.zero_ablated - self.clean
        return torch.where(gap != 0, (self.zero_ablated - self.spliced) / gap, float("nan"))

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(dict(prompt=range(len(self.clean)), hook_name=self.hook_name, clean_loss=self.clean.tolist(),
                                 spliced_loss=self.spliced.tolist(), zero_ablated_loss=self.zero_ablated.tolist(),
                                 recovered=self.recovered.tolist()))


def _zero(activation: torch.Tensor, hook: HookPoint) -> torch.Tensor:
    return torch.zeros_like(activation)


@torch.no_grad()
def sae_loss_recovered(
    model: HookedDecoder, sae: SparseAutoencoder, input: AnalysisInput, *, attention_mask: Optional[torch.Tensor] = None
) -> SAELossRecovered:
    """The loss of each prompt clean, with the SAE spliced in (`probe.spliced`, no error term), and with
    the SAE's hook point zero-ablated; `recovered` compares them. Three forwards."""
    name = check_sae(model, sae)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    forward_mask = model_mask(mask)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return loss_metric(logits, tokens, mask).cpu()

    clean = loss(model(tokens, attention_mask=forward_mask))
    with spliced(model, sae):
        with_sae = loss(model(tokens, attention_mask=forward_mask))
    zero = loss(model.run_with_hooks(tokens, attention_mask=forward_mask, fwd_hooks=[(name, _zero)]))
    return SAELossRecovered(name, clean, with_sae, zero)
