"""Edges, edge patches, path patches and circuits computed by hand on transformer-lens's HookedTransformer: the
oracle of tests/test_circuit_toy.py, run in the SAELens virtualenv by tests/saelens_oracle.py's `circuits`
command (this file imports nothing of probe's).

Every reader's input is its own hook point: `use_split_qkv_input` gives each head's q, k and v input
(hook_q_input / hook_k_input / hook_v_input [batch pos head d_model]), `use_hook_mlp_in` each MLP's, and the
last hook_resid_post is the logits'. Writers are hook_embed (plus hook_pos_embed where positions join the
residual), each head's hook_result and each hook_mlp_out. A reader's input gradient is the gradient at its hook
point; a patched reader is its hook point edited.
"""
from __future__ import annotations

import torch


def names(cfg) -> tuple[list[str], list[str]]:
    """(writers, readers) in probe's notation, in its order (analyses/circuit_graph.py)."""
    mlps = not cfg.attn_only
    writers, readers = ["embed"], []
    for l in range(cfg.n_layers):
        writers += [f"L{l}H{h}" for h in range(cfg.n_heads)] + [f"L{l} mlp"] * mlps
        readers += [f"L{l}H{h}<{p}" for p in "qkv" for h in range(cfg.n_heads)] + [f"L{l} mlp"] * mlps
    return writers, readers + ["logits"]


def reader_hook(cfg, reader: str) -> tuple[str, int]:
    """(hook name, head or -1) of a reader's input."""
    if reader == "logits":
        return f"blocks.{cfg.n_layers - 1}.hook_resid_post", -1
    layer, rest = reader[1:].split("H", 1) if "<" in reader else (reader[1:].split(" ")[0], None)
    if rest is None:
        return f"blocks.{layer}.hook_mlp_in", -1
    head, part = rest.split("<")
    return f"blocks.{layer}.hook_{part}_input", int(head)


class ByHand:
    def __init__(self, model, clean, corrupted, answers, wrongs):
        model.set_use_split_qkv_input(True)
        model.set_use_attn_result(True)
        if not model.cfg.attn_only:
            model.set_use_hook_mlp_in(True)
        self.model, self.cfg = model, model.cfg
        self.clean, self.corrupted = clean, corrupted
        self.answers, self.wrongs = torch.tensor(answers), torch.tensor(wrongs)
        self.writers, self.readers = names(model.cfg)
        with torch.no_grad():
            _, self.clean_cache = model.run_with_cache(clean)
            logits, self.corr_cache = model.run_with_cache(corrupted)
        self.corrupted_value = self.metric(logits)

    def metric(self, logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0])
        return logits[rows, -1, self.answers] - logits[rows, -1, self.wrongs]

    def outputs(self, cache) -> torch.Tensor:
        """[batch pos writer d_model]"""
        embed = cache["hook_embed"]
        if self.cfg.positional_embedding_type == "standard":
            embed = embed + cache["hook_pos_embed"]
        parts = [embed[:, :, None]]
        for l in range(self.cfg.n_layers):
            parts.append(cache[f"blocks.{l}.attn.hook_result"])
            if not self.cfg.attn_only:
                parts.append(cache[f"blocks.{l}.hook_mlp_out"][:, :, None])
        return torch.cat(parts, dim=2)

    def gradients(self, tokens, embed=None) -> torch.Tensor:
        """[batch pos reader d_model]: the metric's gradient at every reader's input, in a run of `tokens` (its
        hook_embed replaced by `embed` when given)."""
        kept = {}

        def keep(act, hook):
            if not act.requires_grad:  # downstream of an embedding given as a constant: a leaf of the graph
                act = act.detach().requires_grad_(True)
            act.retain_grad()
            kept[hook.name] = act
            return act

        hooks = [(name, keep) for name in sorted({reader_hook(self.cfg, r)[0] for r in self.readers})]
        if embed is not None:
            hooks.append(("hook_embed", lambda act, hook: embed))
        value = self.metric(self.model.run_with_hooks(tokens, fwd_hooks=hooks)).sum()
        value.backward()
        grads = []
        for reader in self.readers:
            name, head = reader_hook(self.cfg, reader)
            grad = kept[name].grad
            grads.append(grad[:, :, head] if head >= 0 else grad)
        return torch.stack(grads, dim=2).detach()

    def edge_scores(self, steps: int = 1, clean_too: bool = False) -> torch.Tensor:
        """[batch writer reader]: delta . gradient summed over positions; the gradient the corrupted run's (averaged
        with the clean run's when `clean_too`), or averaged over `steps` runs from embeddings interpolated from the
        corrupted to the clean ones (EAP-IG on the inputs; steps=1 is EAP)."""
        delta = self.outputs(self.clean_cache) - self.outputs(self.corr_cache)
        if clean_too:
            grads = (self.gradients(self.corrupted) + self.gradients(self.clean)) / 2
        else:
            e_clean, e_corr = self.clean_cache["hook_embed"], self.corr_cache["hook_embed"]
            grads = sum(self.gradients(self.corrupted, e_corr + k / steps * (e_clean - e_corr)) for k in range(steps)) / steps
        return torch.einsum("bpwd,bprd->bwr", delta, grads)

    @torch.no_grad()
    def exact(self) -> torch.Tensor:
        """[batch writer reader]: the metric's change with one edge alone carrying the clean output (nan where the
        pair is not an edge)."""
        delta = self.outputs(self.clean_cache) - self.outputs(self.corr_cache)
        out = torch.full((self.clean.shape[0], len(self.writers), len(self.readers)), float("nan"))
        for r, reader in enumerate(self.readers):
            name, head = reader_hook(self.cfg, reader)
            for w, writer in enumerate(self.writers):
                if not self.writes_before(writer, reader):
                    continue

                def add(act, hook, w=w, head=head):
                    act = act.clone()
                    if head >= 0:
                        act[:, :, head] += delta[:, :, w]
                    else:
                        act += delta[:, :, w]
                    return act

                logits = self.model.run_with_hooks(self.corrupted, fwd_hooks=[(name, add)])
                out[:, w, r] = self.metric(logits) - self.corrupted_value
        return out

    def writes_before(self, writer: str, reader: str) -> bool:
        """Whether the reader reads the residual after the writer wrote to it (sequential blocks)."""
        def stage(name):  # 0 the embedding, 2l+1 layer l's attention, 2l+2 its MLP, 2 n_layers + 1 the logits
            if name in ("embed", "logits"):
                return 0 if name == "embed" else 2 * self.cfg.n_layers + 1
            layer = int(name[1:].split("H")[0].split(" ")[0])
            return 2 * layer + (2 if name.endswith("mlp") else 1)
        return stage(writer) < stage(reader)

    @torch.no_grad()
    def path_patch(self, sender: str, receivers: list[str]) -> torch.Tensor:
        """[batch]: the corrupted run with each receiver's input its corrupted input plus the sender's clean-minus-
        corrupted output (the receivers hear the sender alone), their norm scales held at the corrupted run's."""
        delta = self.outputs(self.clean_cache) - self.outputs(self.corr_cache)
        w = self.writers.index(sender)
        hooks = []
        for reader in receivers:
            name, head = reader_hook(self.cfg, reader)

            def add(act, hook, head=head):  # the corrupted input plus the sender's change: no other change reaches it
                act = act.clone()
                frozen = self.corr_cache[hook.name]
                if head >= 0:
                    act[:, :, head] = frozen[:, :, head] + delta[:, :, w]
                else:
                    act = frozen + delta[:, :, w]
                return act

            hooks.append((name, add))
            layer = name.split(".")[1]
            scale = {"logits": "ln_final.hook_scale", "mlp": f"blocks.{layer}.ln2.hook_scale"}.get(
                reader.split(" ")[-1], f"blocks.{layer}.ln1.hook_scale")
            if scale not in self.model.hook_dict:
                continue
            # ln1 runs on the q, then the k, then the v inputs, each a copy per head with its own scale: only the
            # receiver's call and head is held
            calls = [0]

            def freeze(act, hook, head=head, part=reader[-1], calls=calls):
                call, calls[0] = calls[0], calls[0] + 1
                if head < 0:
                    return self.corr_cache[hook.name].clone()
                if "qkv"[call % 3] != part:
                    return None
                act = act.clone()
                act[:, :, head] = self.corr_cache[hook.name][:, :, head]
                return act

            hooks.append((scale, freeze))
        return self.metric(self.model.run_with_hooks(self.corrupted, fwd_hooks=hooks))

    @torch.no_grad()
    def circuit(self, edges: list[tuple[str, str]]) -> torch.Tensor:
        """[batch]: the corrupted run with every reader's input rebuilt as its corrupted input plus, for each kept
        edge, (what the writer outputs in this run - its corrupted output); the embedding's kept edges carry the
        clean embedding."""
        corr_out = self.outputs(self.corr_cache)
        clean_embed = self.outputs(self.clean_cache)[:, :, 0]
        current = {"embed": clean_embed}
        kept = {}
        for writer, reader in edges:
            kept.setdefault(reader, []).append(writer)

        def capture_heads(act, hook):
            layer = int(hook.name.split(".")[1])
            for h in range(self.cfg.n_heads):
                current[f"L{layer}H{h}"] = act[:, :, h]

        def capture_mlp(act, hook):
            current[f"L{hook.name.split('.')[1]} mlp"] = act

        def rebuild(act, hook):
            act = act.clone()
            for reader in self.readers:
                name, head = reader_hook(self.cfg, reader)
                if name != hook.name:
                    continue
                value = self.corr_cache[name][:, :, head] if head >= 0 else self.corr_cache[name]
                for writer in kept.get(reader, []):
                    value = value + current[writer] - corr_out[:, :, self.writers.index(writer)]
                if head >= 0:
                    act[:, :, head] = value
                else:
                    act = value
            return act

        hooks = [(name, rebuild) for name in sorted({reader_hook(self.cfg, r)[0] for r in self.readers})]
        for l in range(self.cfg.n_layers):
            hooks.append((f"blocks.{l}.attn.hook_result", capture_heads))
            if not self.cfg.attn_only:
                hooks.append((f"blocks.{l}.hook_mlp_out", capture_mlp))
        return self.metric(self.model.run_with_hooks(self.corrupted, fwd_hooks=hooks))


def circuits_by_hand(model, clean, corrupted, spec: dict) -> dict:
    """Every result tests/test_circuit_toy.py compares, by name."""
    hand = ByHand(model, clean, corrupted, spec["answers"], spec["wrongs"])
    out = {"eap": hand.edge_scores(), "clean_corrupted": hand.edge_scores(clean_too=True),
           "eap_ig_inputs": hand.edge_scores(steps=3), "exact": hand.exact()}
    for i, (sender, receivers) in enumerate(spec["paths"]):
        out[f"path.{i}"] = hand.path_patch(sender, receivers)
    for i, edges in enumerate(spec["circuits"]):
        out[f"circuit.{i}"] = hand.circuit([tuple(e) for e in edges])
    return out
