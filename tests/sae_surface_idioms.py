"""SAELens 6's SAE surface as SAELens code reads it (`load_from_disk(path, dtype="float32", fold_W_dec_norm=)`,
`cfg.architecture()`, `cfg.metadata.prepend_bos` / `["hook_name"]`, `cfg.dtype`, `cfg.to_dict()`, `get_W_dec_norm`,
`get_name`, a hook_z SAE's per-head `decode`, `save_model`), written once: the oracle (tests/saelens_oracle.py
`sae_surface`, SAELens's SAE class) and tests/test_sae_surface.py (probe.SparseAutoencoder) each run `sae_surface_idioms`
on SAE directories SAELens wrote. Attribute access only; the SAE class is passed in."""
from __future__ import annotations

import torch

TO_DICT_KEYS = ("architecture", "d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
                "reshape_activations")


def sae_surface_idioms(sae_class, directories: dict, z: torch.Tensor, saved_to: str) -> tuple[dict, dict]:
    """(tensors, plain values) by name. `directories`: {"z": a standard SAE on hook_z, "topk": a TopK SAE}."""
    tensors, values = {}, {}
    sae = sae_class.load_from_disk(directories["z"], device="cpu", dtype="float32")
    cfg, meta = sae.cfg, sae.cfg.metadata
    values["cfg"] = [cfg.architecture(), cfg.d_in, cfg.d_sae, cfg.dtype, cfg.device, cfg.normalize_activations,
                     cfg.reshape_activations, cfg.apply_b_dec_to_input]
    values["metadata"] = [meta.hook_name, meta.model_name, meta.hook_layer, meta.prepend_bos, meta.context_size,
                          meta.hook_head_index, meta["hook_name"], meta.get("not_a_field", 5), "hook_name" in meta,
                          "not_a_field" in meta]
    as_dict = cfg.to_dict()
    values["to_dict"] = [as_dict[key] for key in TO_DICT_KEYS] + [as_dict["metadata"]["hook_name"]]
    values["name"] = sae.get_name()
    with torch.no_grad():
        tensors["W_dec_norm"] = sae.get_W_dec_norm()
        features = sae.encode(z)
        tensors["features"] = features
        recons = sae.decode(features)
        tensors["recons"] = recons  # per head, as z
        tensors["mse_by_hand"] = (recons - z).pow(2).mean().reshape(1)
        # sae-dashboard reads the switch, turns it off, and encodes heads already flattened
        modes = [sae.hook_z_reshaping_mode]
        sae.turn_on_forward_pass_hook_z_reshaping()
        modes.append(sae.hook_z_reshaping_mode)
        tensors["forward"] = sae(z)
        sae.turn_off_forward_pass_hook_z_reshaping()
        modes.append(sae.hook_z_reshaping_mode)
        tensors["features_of_flat_heads"] = sae.encode(z.flatten(-2))
        tensors["recons_of_flat_heads"] = sae.decode(tensors["features_of_flat_heads"])
        sae.turn_on_forward_pass_hook_z_reshaping()
        values["hook_z_reshaping_mode"] = modes
        folded = sae_class.load_from_disk(directories["z"], dtype="float32", fold_W_dec_norm=True)
        tensors["folded_norms"] = folded.W_dec.norm(dim=-1)
        tensors["folded_features"] = folded.encode(z)
        sae.save_model(saved_to)
        tensors["reloaded_features"] = sae_class.load_from_disk(saved_to).encode(z)
        half = sae_class.load_from_disk(directories["z"], dtype="bfloat16")
        values["half_dtype"] = [half.cfg.dtype, str(half.W_enc.dtype)]
    topk = sae_class.load_from_disk(directories["topk"])
    values["topk_architecture"] = topk.cfg.architecture()
    try:
        topk.fold_W_dec_norm()
        values["topk_fold"] = "folded"
    except NotImplementedError:
        values["topk_fold"] = "NotImplementedError"
    return tensors, values
