"""The local replacement model behind an attribution graph (Ameisen et al. 2025, "Circuit tracing").

Each MLP is replaced by its transcoder's output plus an error node per position, the MLP's true output minus
the transcoder's, so the replacement computes exactly what the model does on this prompt. Freezing the
attention patterns and every norm's scale at their values on the prompt then makes the rest linear: each
node's contribution flows to the logits through the residual stream, the values and output weights of the
heads (patterns fixed) and the norms (scales fixed), and nowhere else.

The nodes that write are the active transcoder features (activation a times the decoder row W_dec[f]), the
error nodes (one vector per layer and position) and the embedding nodes (the residual entering block 0 at
each position: token plus position embedding; a shortformer model's positions join only the queries and keys,
so they act through the frozen patterns and its embedding nodes hold the tokens alone). Their writes are treated
as constants (direct effects only): no gradient runs through an encoder, so a feature's influence on a later one
is its edge alone, and the later one's own response to it is another edge. TopK's selection is frozen with
everything else: the active set is the one chosen on the prompt, and an active feature's activation is its
pre-activation (the k largest are kept only when positive, so relu is the identity on them).

What a node reads (a target): an active feature's pre-activation x . W_enc[:, f] + b_enc[f], x being the
transcoder's input in the linearised run, and a logit demeaned over the vocabulary, logit(v) - mean logit, as
circuit-tracer does: the direction W_U[:, v] - mean_v W_U of the final norm's output (its scale frozen, before
any soft cap), which no constant shift of every logit changes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

from probe.analyses.architecture import require_mlps
from probe import HookedDecoder, NormPlacement, SparseAutoencoder
from probe.sae import BUNDLED_SAES, spliced

TranscoderSpec = Union[str, Path, SparseAutoencoder, Sequence[Union[str, Path, SparseAutoencoder]],
                       Mapping[int, SparseAutoencoder]]
BUNDLED = "bundled"
# what a transcoder of block L may read: points before its MLP that are linear in the residual once the scale is frozen
READS = ("ln2.hook_normalized", "hook_mlp_in", "hook_resid_mid")
FROZEN = (".hook_scale", ".hook_pattern")  # every norm's scale (ln1, ln2, ln_final, ...) and every head's pattern
EMBED_POINT = "blocks.0.hook_resid_pre"


def mlp_out_name(layer: int) -> str:
    return f"blocks.{layer}.hook_mlp_out"


def load_transcoders(model: HookedDecoder, transcoders: TranscoderSpec) -> dict[int, SparseAutoencoder]:
    """{layer: transcoder} from "bundled" (the ones shipped for the bundled model, probe/data/saes/transcoder-L),
    a directory, SparseAutoencoder objects, or a list or {layer: ...} of those; each checked to write
    blocks.L.hook_mlp_out and read a point of block L before its MLP. A layer without one keeps its MLP
    whole as its error node (the MLP's output, a constant of the linearisation)."""
    require_mlps(model, "attribution graphs (attribution_graph, intervene)", "no MLP for a transcoder to replace",
                 "read its heads instead: their direct effects with probe.analyses.direct_logit_attribution, their "
                 "causal ones with patch(..., sites='heads') or ablate_heads")
    if isinstance(transcoders, str) and transcoders == BUNDLED:
        found = sorted(BUNDLED_SAES.glob("transcoder-*"))
        if not found:
            raise FileNotFoundError(f"no bundled transcoders under {BUNDLED_SAES}: reinstall probe, or pass directories")
        transcoders = [str(path) for path in found]
    if isinstance(transcoders, (str, Path, SparseAutoencoder)):
        transcoders = [transcoders]
    # a mapping's keys are the layers the caller meant: each is checked against the layer its transcoder writes
    keyed = list(transcoders.items()) if isinstance(transcoders, Mapping) else [(None, t) for t in transcoders]
    if not keyed:
        raise ValueError("no transcoders given: pass 'bundled', directories or SparseAutoencoder objects")
    out: dict[int, SparseAutoencoder] = {}
    for key, item in keyed:
        sae = item if isinstance(item, SparseAutoencoder) else SparseAutoencoder.from_pretrained(item)
        layer = check_transcoder(model, sae, where=str(item) if not isinstance(item, SparseAutoencoder) else None)
        if key is not None and key != layer:
            raise ValueError(f"the transcoder given for layer {key!r} writes {mlp_out_name(layer)} (layer {layer}); "
                             "key each transcoder by the layer whose MLP it replaces, or pass a list")
        if layer in out:
            raise ValueError(f"two transcoders write {mlp_out_name(layer)}; give one per layer")
        dtype = model.embed.W_E.dtype
        if (sae.W_enc.device, sae.W_enc.dtype) != (model.device, dtype):  # a copy: the caller's SAE stays as it was
            sae = copy.deepcopy(sae).to(model.device, dtype)
        out[layer] = sae
    return dict(sorted(out.items()))


def check_transcoder(model: HookedDecoder, sae: SparseAutoencoder, where: Optional[str] = None) -> int:
    """The layer whose MLP `sae` replaces, once checked to fit the model; a one-line error naming the problem."""
    cfg, what = sae.cfg, f"the transcoder {where}" if where else "the transcoder"
    if not cfg.is_transcoder:
        raise ValueError(f"{what} is an SAE on {cfg.hook_name!r}, not a transcoder: attribution graphs replace MLPs, "
                         "so each needs hook_name_out = blocks.L.hook_mlp_out")
    if cfg.skip:
        raise ValueError(f"{what} is a skip-transcoder; its linear path is not supported here yet (use a plain one)")
    parts = cfg.hook_name_out.split(".")
    if not (len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "hook_mlp_out"):
        raise ValueError(f"{what} writes {cfg.hook_name_out!r}; an attribution graph needs transcoders that write "
                         "blocks.L.hook_mlp_out")
    layer = int(parts[1])
    if layer >= model.cfg.n_layers:
        raise ValueError(f"{what} writes {cfg.hook_name_out!r} but the model has {model.cfg.n_layers} layers: a "
                         "transcoder for another model")
    if cfg.hook_name not in {f"blocks.{layer}.{read}" for read in READS}:
        raise ValueError(f"{what} reads {cfg.hook_name!r}; a transcoder of layer {layer} must read one of "
                         + ", ".join(f"blocks.{layer}.{read}" for read in READS))
    if cfg.hook_name == f"blocks.{layer}.ln2.hook_normalized" and model.cfg.norm_placement == NormPlacement.POST:
        # a post-norm block's ln2 normalises resid_mid + mlp_out: a transcoder there would read its own output (a cycle)
        raise ValueError(f"{what} reads {cfg.hook_name!r}, which in this post-norm model comes after the MLP it "
                         f"replaces; read blocks.{layer}.hook_mlp_in (the MLP's input) instead")
    model.hook_point(cfg.hook_name)  # a point this model lacks fails here, with the closest names
    if cfg.d_in != model.cfg.d_model or cfg.d_out != model.cfg.d_model:
        raise ValueError(f"{what} maps {cfg.d_in} -> {cfg.d_out} dimensions but the model's d_model is "
                         f"{model.cfg.d_model}: a transcoder for another model")
    return layer


@dataclass
class ReplacementState:
    """The model's clean run on one prompt: what the linearisation freezes, and every node's vector."""

    tokens: torch.Tensor  # [pos]
    logits: torch.Tensor  # [pos vocab]: the model's own
    frozen: dict[str, torch.Tensor]  # hook name -> [1 ...]: every scale and pattern
    embeddings: torch.Tensor  # [pos d_model]: the residual entering block 0, one embedding node per position
    mlp_out: torch.Tensor  # [layer pos d_model]: each MLP's true output
    features: dict[int, torch.Tensor]  # layer -> [pos d_sae]: the transcoder's activations
    errors: torch.Tensor  # [layer pos d_model]: mlp_out - the transcoder's output (all of it without a transcoder)

    @property
    def n_pos(self) -> int:
        return self.tokens.shape[0]


@torch.no_grad()
def replacement_state(model: HookedDecoder, transcoders: Mapping[int, SparseAutoencoder],
                      tokens: torch.Tensor) -> ReplacementState:
    """One forward pass of the model on `tokens` [pos], caching what the replacement model needs."""
    n_layers = model.cfg.n_layers
    inputs = {layer: sae.cfg.hook_name for layer, sae in transcoders.items()}
    frozen = [n for n in model.hook_names if n.endswith(FROZEN)]
    names = frozen + [EMBED_POINT] + [mlp_out_name(layer) for layer in range(n_layers)] + list(inputs.values())
    logits, cache = model.run_with_cache(tokens[None], names=list(dict.fromkeys(names)))
    mlp_out = torch.stack([cache[mlp_out_name(layer)][0] for layer in range(n_layers)])
    errors, features = mlp_out.clone(), {}
    for layer, sae in transcoders.items():
        acts = sae.feature_activations(cache[inputs[layer]][0])  # [pos d_sae], no hooks
        features[layer] = acts
        errors[layer] = mlp_out[layer] - (acts @ sae.W_dec + sae.b_dec)
    return ReplacementState(tokens=tokens, logits=logits[0], frozen={n: cache[n] for n in frozen},
                            embeddings=cache[EMBED_POINT][0], mlp_out=mlp_out, features=features, errors=errors)


def replacement_logits(model: HookedDecoder, transcoders: Mapping[int, SparseAutoencoder],
                       tokens: torch.Tensor) -> torch.Tensor:
    """[pos vocab]: the replacement model's logits, a real forward with every transcoder spliced in and its error
    term added back: the model's own logits, up to rounding."""
    with torch.no_grad(), spliced(model, list(transcoders.values()), use_error_term=True):
        return model(tokens[None])[0]


@dataclass
class LinearisedRun:
    """One forward pass of the linearised replacement model on `batch` copies of the prompt: the sources (leaves
    whose gradient each target's row is read from) and the readouts (what targets read, still in the graph)."""

    embed: torch.Tensor  # [batch pos d_model] leaf: the embedding nodes' writes
    mlp_out: list[torch.Tensor]  # layer -> [batch pos d_model] leaf: features' + error's writes (+ b_dec)
    inputs: dict[int, torch.Tensor]  # layer -> [batch pos d_in]: each transcoder's input
    final: torch.Tensor  # [batch pos d_model]: the final norm's output, what the unembedding reads

    @property
    def sources(self) -> list[torch.Tensor]:
        return [self.embed, *self.mlp_out]


def linearised_run(model: HookedDecoder, transcoders: Mapping[int, SparseAutoencoder], state: ReplacementState,
                   batch: int, zero_sources: bool = False) -> LinearisedRun:
    """The linearised forward: patterns and scales replaced by their clean values, the input embedding and every
    MLP's output replaced by leaves holding their clean values (with `zero_sources`, every node's write removed:
    zeros, and each transcoder's b_dec; then every target reads its bias terms alone). Gradients flow only
    through the linear paths."""
    n_layers = model.cfg.n_layers
    def expand(clean: torch.Tensor, constant=None) -> torch.Tensor:  # [pos d_model] -> a [batch pos d_model] leaf
        value = clean if not zero_sources else torch.zeros_like(clean) if constant is None else constant.expand_as(clean)
        return value.detach().expand(batch, *clean.shape).clone().requires_grad_()

    embed = expand(state.embeddings)
    # zeroed, an MLP's output keeps its transcoder's b_dec: a bias term, not any node's write
    mlp_out = [expand(state.mlp_out[layer], transcoders[layer].b_dec if layer in transcoders else None)
               for layer in range(n_layers)]
    leaves = {EMBED_POINT: embed, **{mlp_out_name(layer): mlp_out[layer] for layer in range(n_layers)}}
    read_at = {sae.cfg.hook_name: layer for layer, sae in transcoders.items()}
    inputs: dict[int, torch.Tensor] = {}

    def freeze(activation: torch.Tensor, hook) -> torch.Tensor:
        return state.frozen[hook.name].expand_as(activation)

    def source(activation: torch.Tensor, hook) -> torch.Tensor:
        return leaves[hook.name]

    def read(activation: torch.Tensor, hook) -> None:
        inputs[read_at[hook.name]] = activation

    hooks = [(name, freeze) for name in state.frozen] + [(name, source) for name in leaves] + \
        [(name, read) for name in read_at]
    with torch.enable_grad(), model.hooks(hooks):
        resid = model(state.tokens.expand(batch, -1), stop_at_layer=n_layers)
        final = model.ln_final(resid)  # its hook_scale is frozen too
    return LinearisedRun(embed=embed, mlp_out=mlp_out, inputs=inputs, final=final)


def demeaned_unembedding(model: HookedDecoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n d_model], [n]): the directions W_U[:, v] - mean_v W_U and biases b_U[v] - mean b_U of the logits `ids`."""
    W_U = model.W_U.detach()
    directions = (W_U[:, ids] - W_U.mean(dim=1, keepdim=True)).T
    b_U = model.b_U
    bias = torch.zeros(len(ids), dtype=W_U.dtype, device=W_U.device) if b_U is None else (b_U[ids] - b_U.mean()).detach()
    return directions, bias


def promoted_tokens(model: HookedDecoder, directions: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """([n k] ids, [n k] logits): the tokens that residual directions [n d_model] promote most, read through the
    final norm's weight (centred first under a LayerNorm), its scale left out: a direction's logit effect per unit."""
    directions = directions.detach().float()
    norm = model.ln_final
    if hasattr(norm, "b"):  # a LayerNorm centres before it scales
        directions = directions - directions.mean(dim=-1, keepdim=True)
    if hasattr(norm, "w"):
        directions = directions * norm.w.detach().float()
    logits = directions @ model.W_U.detach().float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return top.indices, top.values
