"""A sparse autoencoder's features on a prompt, what each feature writes, and what the SAE costs the model.

An SAE (`probe.SparseAutoencoder`) reads the activation x at its hook point and writes it back as a
sparse sum of decoder rows, x_hat = sum_f a_f W_dec[f] + b_dec. A transcoder reads x at `hook_name`
(an MLP's input) and writes y_hat, its prediction of the activation y at `hook_name_out` (the MLP's
output), with the same formula (plus x W_skip^T for a skip-transcoder): its features are read from
x, and what they write is judged at `hook_name_out` (`output_hook`).

- `sae_features`: per position, the k most active features, L0 (how many are active) and the
  relative error of what it writes, ||y - y_hat||^2 / ||y - mean(y)||^2 (y = x for an SAE).
- `feature_logits`: the tokens each feature's decoder row promotes and suppresses when read through
  the final norm's weight and the unembedding, as `value_tokens(..., through_final_norm=True)` reads
  an FFN value (a transcoder's rows as written at its output point).
- `feature_inputs`: the input side, the tokens whose embeddings excite and inhibit each feature most
  along the direct path from the embedding to the encoder.
- `sae_loss_recovered`: the next-token loss of the clean model, of the model running on the SAE's
  reconstruction, and of the model with the written activation zeroed; recovered = (zero - spliced) / (zero - clean).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum, rearrange

from probe.analyses.ablation import loss_metric
from probe.analyses.architecture import refuse_bidirectional, refuse_shortformer, require_head_weights
from probe.analyses.common import AnalysisInput, PromotedTokens, TableDisplay, escape_token, is_int, model_mask, token_decoder, tokens_and_mask, top_count
from probe.analyses.sae_checks import FeatureSpec, check_sae, feature_ids, output_hook
from probe.analyses.vocab_projection import final_norm_directions, top_tokens, value_directions
from probe.hooks import HookPoint
from probe import HookedDecoder, Norm, SparseAutoencoder, spliced

__all__ = ["FeatureInputs", "FeatureLogits", "FeatureSpec", "SAEFeatures", "SAELossRecovered", "check_sae", "feature_ids",
           "feature_inputs", "feature_logits", "output_hook", "sae_features", "sae_loss_recovered"]


TOP_K = 10  # features per position and tokens per feature when k is not given (fewer where there are fewer)


# ---- sae_features --------------------------------------------------------------------------------
@dataclass
class SAEFeatures(TableDisplay):
    """The SAE's features on a batch of prompts; dimensions `batch pos k`, padding marked by `mask`. For a
    transcoder the features are read at `hook_name` and `fvu` is of its prediction at `hook_name_out`."""

    hook_name: str
    tokens: torch.Tensor  # [batch pos]
    mask: torch.Tensor  # [batch pos] bool: real tokens
    token_strings: list[list[str]]  # [batch][pos]: each token's raw string (escape before HTML)
    top_ids: torch.Tensor  # [batch pos k] int64, most active first; -1 past the active ones and at padding
    top_activations: torch.Tensor  # [batch pos k] float32; 0 where top_ids is -1
    l0: torch.Tensor  # [batch pos] int64: active features (0 at padding)
    fvu: torch.Tensor  # [batch pos] float32: ||y - y_hat||^2 / ||y - mean(y)||^2, mean over y's entries; NaN at padding
    feature_ids: torch.Tensor  # [feature]: every feature in some real position's top k, ascending
    feature_activations: torch.Tensor  # [batch pos feature] float32: those features' activations everywhere (0 at padding)
    hook_name_out: Optional[str] = None  # a transcoder: the point it writes (y there; y = x for an SAE)

    @property
    def k(self) -> int:
        return self.top_ids.shape[-1]

    def to_frame(self) -> pd.DataFrame:
        """One row per (prompt, real position, rank from 1) of an active feature, with the position's L0 and
        fvu. A position where no feature is active keeps one row, its rank and feature empty."""
        rows = []
        for b, p in self.mask.nonzero().tolist():
            base = (b, p, self.token_strings[b][p])
            stats = (int(self.l0[b, p]), float(self.fvu[b, p]))
            active = [r for r in range(self.k) if int(self.top_ids[b, p, r]) >= 0]
            for r in active:
                rows.append(base + (r + 1, int(self.top_ids[b, p, r]), float(self.top_activations[b, p, r])) + stats)
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
        where = f"SAE features at {escape_token(self.hook_name)}" if self.hook_name_out is None else \
            f"transcoder features at {escape_token(self.hook_name)} (writing {escape_token(self.hook_name_out)})"
        fig.update_layout(title=f"{where}: {shown} features in some position's top {self.k}",
                          xaxis_title="feature", height=200 + 22 * len(labels))
        return fig


@torch.no_grad()
def sae_features(
    model: HookedDecoder,
    sae: SparseAutoencoder,
    input: AnalysisInput,
    k: Optional[int] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> SAEFeatures:
    """The SAE's features at every real position of `input`: the k most active (default 10, or d_sae if fewer;
    fewer where fewer are active), L0, and the relative squared error of what it writes (a transcoder's prediction
    of the activation at its output point). One forward, caching only the SAE's hook points."""
    name = check_sae(model, sae)
    written = output_hook(sae)
    k = top_count(k, sae.cfg.d_sae, "d_sae", TOP_K)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    _, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=sorted({name, written}))
    x = cache[name].to(sae.W_enc.device)
    encoded = sae.encode(x)  # the SAE says it when x has the wrong width
    if tuple(encoded.shape[:-1]) != tuple(tokens.shape):
        raise ValueError(f"the SAE's features at {name!r} have shape {tuple(encoded.shape)}; sae_features reads one "
                         f"activation vector per position, [batch pos d_sae]")
    # hook_z: [... head d_head] -> [... (head d_head)], as the SAE reads it; y_hat is the SAE's output (a
    # skip-transcoder's linear path included)
    y = cache[written].to(sae.W_enc.device).reshape(*tokens.shape, -1).float()
    y_hat = sae(x).reshape(*tokens.shape, -1).float()
    error = (y - y_hat).pow(2).sum(-1)
    spread = (y - y.mean(-1, keepdim=True)).pow(2).sum(-1)
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
        hook_name_out=sae.cfg.hook_name_out,
    )


# ---- feature_logits ------------------------------------------------------------------------------
def _residual_write(model: HookedDecoder, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The linear map from directions at `name` [n width] to what they add to the residual stream [n d_model],
    float32. Found by the hook point's identity, not its name."""
    point = model.hook_point(name)
    for layer, block in enumerate(model.blocks):
        if point is block.attn.hook_z:
            if model.cfg.mixture_of_attention is not None:  # (no one W_O per head: latent attention has its own)
                require_head_weights(model, f"feature_logits of an SAE at {name!r}")
            W_O = block.attn.W_O.detach().float()  # [head d_head d_model]
            # a sandwich block's attention write is normalised: times ln1_post.w over a per-position scale
            post = block.ln1_post.w.detach().float() if hasattr(block, "ln1_post") else None

            def through_W_O(directions: torch.Tensor) -> torch.Tensor:
                heads = rearrange(directions, "n (head d_head) -> n head d_head", head=W_O.shape[0])
                written = einsum(heads, W_O, "n head d_head, head d_head d_model -> n d_model")
                return written if post is None else written * post

            return through_W_O
        mlp = getattr(block, "mlp", None)  # an attention-only block has none
        if mlp is not None and point is mlp.hook_post:
            values = value_directions(model, layer, torch.arange(mlp.W_out.shape[0]), through_final_norm=False)
            return lambda directions: directions @ values  # [d_mlp d_model]: each neuron's write
    if point is getattr(model, "hook_pos_embed", None):
        refuse_shortformer(model, f"feature_logits of an SAE at {name!r}", "decoder rows there never reach the "
                           "unembedding directly", "use an SAE on the residual stream (hook_resid_pre/post)")
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
    hook_name_out: Optional[str] = None  # a transcoder: the point its decoder rows are written at

    def to_frame(self) -> pd.DataFrame:
        """One row per (feature, direction, rank): the token, its id and its logit."""
        return self._promoted_frame({"feature": self.features.tolist()})

    def figure(self, max_features: int = 20) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits, tokens written in the cells."""
        where = f"SAE at {escape_token(self.hook_name)}" if self.hook_name_out is None else \
            f"transcoder at {escape_token(self.hook_name)}, written at {escape_token(self.hook_name_out)}"
        return self._promoted_figure([f"F{int(f)}" for f in self.features[:max_features]],
                                     f"Tokens promoted and suppressed by the decoder rows of the {where} "
                                     "(W_dec through the final norm and W_U)")


@torch.no_grad()
def feature_logits(model: HookedDecoder, sae: SparseAutoencoder, features: FeatureSpec,
                   k: Optional[int] = None) -> FeatureLogits:
    """The top-k promoted and bottom-k suppressed tokens (k: default 10, or d_vocab_out if fewer) of each
    feature's decoder row W_dec[f], as it reaches the unembedding: through W_O (hook_z) or W_out (mlp.hook_post)
    into the residual stream, then centred (a LayerNorm final norm) and multiplied by the final norm's weight; in
    float32. A transcoder's rows are read where they are written, at hook_name_out (a skip-transcoder's linear
    path belongs to no feature and is left out)."""
    name = check_sae(model, sae)
    ids = feature_ids(sae, features)
    k = top_count(k, model.cfg.d_vocab_out, "d_vocab_out", TOP_K)  # W_U's columns: the output vocabulary
    write = _residual_write(model, output_hook(sae))  # check_sae made sure the SAE's width is the activation's
    W_dec = sae.W_dec.detach()

    def directions(rows: slice) -> torch.Tensor:
        chosen = W_dec[ids[rows].to(W_dec.device)].to(model.device, torch.float32)
        return final_norm_directions(model, write(chosen))

    top_logits, top_ids, bottom_logits, bottom_ids = top_tokens(model, directions, len(ids), k)
    decode = token_decoder(model)
    strings = [decode(top_ids[i].tolist() + bottom_ids[i].tolist()) for i in range(len(ids))]
    return FeatureLogits(name, ids, top_ids, top_logits, bottom_ids, bottom_logits, strings,
                         hook_name_out=sae.cfg.hook_name_out)


# ---- feature_inputs ------------------------------------------------------------------------------
def _embedding_read(model: HookedDecoder, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The linear map from token embeddings [n d_model] to what they put at `name` along the direct path: as they
    are on the residual stream; centred (a LayerNorm) at a norm's hook_normalized, whose per-position scale is left
    out (it divides every token's score alike)."""
    point = model.hook_point(name)
    norms = [getattr(block, norm) for block in model.blocks for norm in ("ln1", "ln2") if hasattr(block, norm)]
    norms.append(model.ln_final)  # (an attention-only block has no ln2)
    if any(point is getattr(norm, "hook_normalized", None) for norm in norms):
        if model.cfg.norm is Norm.LAYER:
            return lambda embedded: embedded - embedded.mean(-1, keepdim=True)
        return lambda embedded: embedded
    residual = ("hook_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post")
    if any(point is getattr(owner, attr, None) for owner in (model, *model.blocks) for attr in residual):
        return lambda embedded: embedded
    raise ValueError(f"feature_inputs reads token embeddings along the residual stream into the encoder, and {name!r} "
                     "is not on it: it takes dictionaries reading the residual stream (hook_embed, hook_resid_pre/mid/"
                     "post) or a norm's hook_normalized (an MLP transcoder's ln2.hook_normalized)")


@dataclass
class FeatureInputs(PromotedTokens):
    """The tokens whose embeddings excite (top) and inhibit (bottom) each feature's pre-activation most, along
    the direct path from the embedding: `top_logits` / `bottom_logits` hold those scores."""

    hook_name: str
    features: torch.Tensor  # [feature]
    top_ids: torch.Tensor  # [feature k], most exciting first
    top_logits: torch.Tensor  # [feature k]: embed(t) (centred at a LayerNorm's output) . W_enc[:, f]
    bottom_ids: torch.Tensor  # [feature k], most inhibiting first
    bottom_logits: torch.Tensor  # [feature k]
    token_strings: list[list[str]]  # [feature] of k exciting strings then k inhibiting strings, raw

    def to_frame(self) -> pd.DataFrame:
        """One row per (feature, direction "excites"/"inhibits", rank): the token, its id and its score."""
        frame = self._promoted_frame({"feature": self.features.tolist()}).rename(columns={"logit": "score"})
        frame["direction"] = frame.direction.map({"promoted": "excites", "suppressed": "inhibits"})
        return frame

    def figure(self, max_features: int = 20) -> go.Figure:
        fig = self._promoted_figure([f"F{int(f)}" for f in self.features[:max_features]],
                                    f"Tokens whose embeddings excite and inhibit the features at "
                                    f"{escape_token(self.hook_name)} (W_E through the norm's centring, then W_enc)")
        for annotation, text in zip(fig.layout.annotations, ("excites", "inhibits")):
            annotation.text = text
        return fig


@torch.no_grad()
def feature_inputs(model: HookedDecoder, sae: SparseAutoencoder, features: FeatureSpec,
                   k: Optional[int] = None) -> FeatureInputs:
    """The input side of `feature_logits`: for each feature, the k tokens (default 10, or d_vocab if fewer) whose
    embeddings (W_E, times the model's embedding scale) raise its pre-activation most and the k that lower it most
    along the direct path, the score embed(t) . W_enc[:, f], centred first where the SAE reads a LayerNorm's
    hook_normalized (an MLP transcoder's input). Positional embeddings, biases and b_dec add the same to every
    token and are left out; in float32."""
    name = check_sae(model, sae)
    ids = feature_ids(sae, features)
    k = top_count(k, model.cfg.d_vocab, "d_vocab", TOP_K)  # W_E's rows: the input vocabulary
    read = _embedding_read(model, name)
    W_enc = sae.W_enc.detach()[:, ids.to(sae.W_enc.device)].T.to(model.device, torch.float32)  # [feature d_in]
    d_vocab = model.cfg.d_vocab
    rows = max(1, (1 << 24) // d_vocab)  # [rows vocab] scores at a time
    cols = max(1, (1 << 24) // model.cfg.d_model)  # [cols d_model] embeddings at a time
    outs = []
    for start in range(0, len(ids), rows):
        scores = W_enc.new_empty(min(rows, len(ids) - start), d_vocab)
        for col in range(0, d_vocab, cols):
            tokens = torch.arange(col, min(col + cols, d_vocab), device=model.device)
            scores[:, col:col + len(tokens)] = W_enc[start:start + rows] @ read(model.embed(tokens).float()).T
        top, bottom = scores.topk(k, dim=-1), scores.topk(k, dim=-1, largest=False)
        outs.append((top.values, top.indices, bottom.values, bottom.indices))
    top_logits, top_ids, bottom_logits, bottom_ids = (torch.cat([o[i] for o in outs]).cpu() for i in range(4))
    decode = token_decoder(model)
    strings = [decode(top_ids[i].tolist() + bottom_ids[i].tolist()) for i in range(len(ids))]
    return FeatureInputs(name, ids, top_ids, top_logits, bottom_ids, bottom_logits, strings)


# ---- sae_loss_recovered --------------------------------------------------------------------------
@dataclass
class SAELossRecovered(TableDisplay):
    """Next-token cross-entropy per prompt (nats, mean over its predicted real tokens) three ways."""

    hook_name: str
    clean: torch.Tensor  # [batch]: the model as it is
    spliced: torch.Tensor  # [batch]: the SAE's reconstruction in place of the activation (no error term)
    zero_ablated: torch.Tensor  # [batch]: the activation it writes set to zero (a transcoder's: at hook_name_out)

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
    the point it writes zero-ablated (an SAE's hook point; a transcoder's output point, the MLP's output);
    `recovered` compares them. Three forwards. Refused on a bidirectional model (no next-token loss)."""
    name = check_sae(model, sae)
    refuse_bidirectional(model, "sae_loss_recovered", "every position already sees the token after it and the next-token "
                         "loss the CE score compares measures nothing the model computes",
                         "judge the SAE by its reconstruction (sae_features' fvu and l0) or by a metric of what the "
                         "model outputs, run with `with probe.spliced(model, sae):` and without")
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    forward_mask = model_mask(mask)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return loss_metric(logits, tokens, mask).cpu()

    clean = loss(model(tokens, attention_mask=forward_mask))
    with spliced(model, sae):
        with_sae = loss(model(tokens, attention_mask=forward_mask))
    zero = loss(model.run_with_hooks(tokens, attention_mask=forward_mask, fwd_hooks=[(output_hook(sae), _zero)]))
    return SAELossRecovered(name, clean, with_sae, zero)
