"""ARENA 1.2's induction-head analyses of its attention-only, shortformer model, written once as transformer-lens
code: the oracle (tests/saelens_oracle.py, HookedTransformer of transformer-lens 3) and
tests/test_attn_only.py (probe) each run `induction_idioms` on a model built from the same config with the same
weights. Attribute access only, no imports from either library: the FactoredMatrix class is `type(model.OV)`."""
from __future__ import annotations

import torch


def induction_idioms(model, tokens: torch.Tensor, seq_len: int) -> dict:
    """`tokens` [batch 1 + 2 seq_len]: a first token, then random tokens repeated once."""
    out = {}
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens[:1], remove_batch_dim=True)
        out["logits"] = logits
        for layer in range(n_layers):
            pattern = cache["pattern", layer]
            out[f"pattern{layer}"] = pattern
            # the detectors: current-token, previous-token, first-token and induction stripes per head
            out[f"detectors{layer}"] = torch.stack([
                torch.stack([pattern[h].diagonal().mean(), pattern[h].diagonal(-1).mean(), pattern[h][:, 0].mean(),
                             pattern[h].diagonal(-seq_len + 1).mean()]) for h in range(n_heads)])

        # the per-token log probs of the repeated sequence, from a cache whose batch dimension is then removed
        rep_logits, rep_cache = model.run_with_cache(tokens[:1])
        rep_cache.remove_batch_dim()
        log_probs = rep_logits.log_softmax(-1)[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0]
        out["log_probs"] = log_probs
        out["rep_q1"] = rep_cache["q", 1]

        # induction scores with a hook on every pattern, chosen by a name filter, and hook.layer()
        store = torch.zeros(n_layers, n_heads)

        def induction_score_hook(pattern, hook):
            stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
            store[hook.layer(), :] = stripe.mean(dim=(0, 2))

        model.run_with_hooks(tokens, return_type=None,
                             fwd_hooks=[(lambda name: name.endswith("pattern"), induction_score_hook)])
        out["induction_scores"] = store

        # direct logit attribution from the embedding and each head's result (use_attn_result=True)
        embed, l1_results, l2_results = cache["embed"], cache["result", 0], cache["result", 1]
        W_U_correct = model.W_U[:, tokens[0, 1:]]
        direct = torch.einsum("ds,sd->s", W_U_correct, embed[:-1])
        l1 = torch.einsum("ds,shd->sh", W_U_correct, l1_results[:-1])
        l2 = torch.einsum("ds,shd->sh", W_U_correct, l2_results[:-1])
        out["logit_attribution"] = torch.cat([direct[:, None], l1, l2], dim=-1)
        out["pos_embed"] = cache["pos_embed"]
        out["resid_pre1_plus_pos"] = cache["resid_pre", 1] + cache["pos_embed"]

        # zero-ablating each head's values, in place, and the loss it costs
        def ablate_head(v, hook, head):
            v[:, :, head, :] = 0.0
            return v

        clean_loss = model(tokens, return_type="loss")
        scores = torch.zeros(n_layers, n_heads)
        for layer in range(n_layers):
            for head in range(n_heads):
                ablated = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[
                    (f"blocks.{layer}.attn.hook_v", lambda v, hook, head=head: ablate_head(v, hook, head))])
                scores[layer, head] = ablated - clean_loss
        out["ablation_scores"] = scores

        # weights: the full OV circuit as a factored matrix, sampled; the previous-token head's positional pattern
        FactoredMatrix = type(model.OV)
        full_OV = model.W_E @ FactoredMatrix(model.W_V[1, 2], model.W_O[1, 2]) @ model.W_U
        indices = torch.arange(0, model.cfg.d_vocab, 3)
        out["full_OV_sample"] = full_OV[indices, indices].AB
        W_QK = model.W_Q[0, 1] @ model.W_K[0, 1].T
        scores_pos = model.W_pos @ W_QK @ model.W_pos.T / model.cfg.d_head ** 0.5
        out["pos_by_pos"] = scores_pos.masked_fill(~torch.ones_like(scores_pos).tril().bool(), -1e6).softmax(-1)

        # the query and key inputs of layer 1, decomposed into embed, pos_embed and layer 0's heads
        decomposed = torch.cat([rep_cache["embed"][None], rep_cache["pos_embed"][None],
                                rep_cache["result", 0].transpose(0, 1)])
        out["decomposed_qk_input"] = decomposed
        q = torch.einsum("nsd,dh->nsh", decomposed, model.W_Q[1, 2])
        k = torch.einsum("nsd,dh->nsh", decomposed, model.W_K[1, 2])
        out["decomposed_scores"] = torch.einsum("qsh,kth->qkst", q, k)

        # composition scores, one by one and batched through factored matrices
        W_QK_all, W_OV_all = model.W_Q @ model.W_K.transpose(-1, -2), model.W_V @ model.W_O

        def comp_score(W_A, W_B):
            return ((W_A @ W_B).pow(2).sum().sqrt() / (W_A.pow(2).sum().sqrt() * W_B.pow(2).sum().sqrt())).item()

        for kind in "QKV":
            out[f"comp_{kind}"] = torch.tensor([[
                comp_score(W_OV_all[0, i], {"Q": W_QK_all[1, j], "K": W_QK_all[1, j].T, "V": W_OV_all[1, j]}[kind])
                for j in range(n_heads)] for i in range(n_heads)])
        OV = FactoredMatrix(model.W_V, model.W_O)
        QK = FactoredMatrix(model.W_Q, model.W_K.transpose(-1, -2))
        As, Bs = OV[0], QK[1].T
        As = FactoredMatrix(As.A.reshape(-1, 1, *As.A.shape[-2:]), As.B.reshape(-1, 1, *As.B.shape[-2:]))
        Bs = FactoredMatrix(Bs.A.reshape(1, -1, *Bs.A.shape[-2:]), Bs.B.reshape(1, -1, *Bs.B.shape[-2:]))
        out["comp_K_batched"] = (As @ Bs).norm() / (As.norm() * Bs.norm())

        # the induction score with the previous-token head's values ablated, kept in the hook's ctx
        def ablation_hook(v, hook):
            v[:, :, 1] = 0.0
            return v

        def induction_pattern_hook(attn, hook):
            hook.ctx[1] = attn[0, 2].diag(-(seq_len - 1)).mean()

        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_v", ablation_hook),
                                                ("blocks.1.attn.hook_pattern", induction_pattern_hook)])
        out["ablated_induction_score"] = model.blocks[1].attn.hook_pattern.ctx[1].reshape(1)
        model.reset_hooks()

        # the cache's decompositions (no MLPs; shortformer positions never enter the residual)
        _, full_cache = model.run_with_cache(tokens)
        stack, labels = full_cache.decompose_resid(return_labels=True)
        out["decompose_resid"] = stack
        out["decompose_resid_n"] = torch.tensor([len(labels)])
        stack, labels = full_cache.accumulated_resid(return_labels=True)
        out["accumulated_resid"] = stack
        out["accumulated_resid_n"] = torch.tensor([len(labels)])
        out["stack_head_results"] = full_cache.stack_head_results(layer=-1)
        out["stack_through_ln_final"] = full_cache.apply_ln_to_stack(stack, layer=-1)
        out["stack_through_ln1_of_1"] = full_cache.apply_ln_to_stack(stack[:3], layer=1)
        # what a cache of everything holds, and an edit at every point a predicate reaches (TL 3.9's unembed points,
        # which probe has not, documented, left out): the same points, so the same logits
        out["n_cached"] = torch.tensor([len([name for name in full_cache.keys() if not name.startswith("unembed.")])])

        def nudge(activation, hook):
            return activation * 1.01 if activation.is_floating_point() else activation

        out["edited_everywhere"] = model.run_with_hooks(tokens, fwd_hooks=[(lambda name: not name.startswith("unembed."),
                                                                            nudge)])

        # the forward written out: input_to_embed, then the blocks from a residual with the positions given
        residual, toks, shortformer_pos_embed, mask = model.input_to_embed(tokens)
        out["input_to_embed"] = residual
        if shortformer_pos_embed is not None:  # None unless the positions are shortformer ones
            out["shortformer_pos_embed"] = shortformer_pos_embed
        out["from_layer_0"] = model(residual, start_at_layer=0, shortformer_pos_embed=shortformer_pos_embed)
        out["loss_per_token"] = model(tokens, return_type="loss", loss_per_token=True)
    return {name: value.detach().float() for name, value in out.items()}
