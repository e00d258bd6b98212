"""Run by the SAELens virtualenv's Python (scripts/saelens_oracle.sh), never imported by the tests: SAELens 6
needs transformer-lens < 4, which the main environment cannot have. Reads and writes safetensors only.

    python saelens_oracle.py encode SAE_DIR INPUTS OUTPUTS
        SAE.load_from_disk(SAE_DIR); INPUTS holds x; OUTPUTS gets features, output (SAELens's forward)
    python saelens_oracle.py loss ARCH SETTINGS_JSON STATE INPUTS OUTPUTS
        a SAELens training SAE of ARCH with the settings, the weights in STATE; INPUTS holds x and dead_mask;
        OUTPUTS gets each loss term, and the gradient of the total loss to every parameter (grad.NAME)
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file


def encode(sae_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(sae_dir, device="cpu")
    x = load_file(inputs)["x"]
    with torch.no_grad():
        features = sae.encode(x)
        out = sae(x)
    save_file({"features": features.contiguous(), "output": out.contiguous()}, outputs)
    print(type(sae).__name__)


def loss(arch: str, settings_json: str, state: str, inputs: str, outputs: str) -> None:
    import sae_lens.saes as saes
    from sae_lens.saes.sae import TrainStepInput

    settings = json.loads(settings_json)
    coefficients = settings.pop("coefficients", {})
    classes = {"standard": ("StandardTrainingSAE", "StandardTrainingSAEConfig"),
               "topk": ("TopKTrainingSAE", "TopKTrainingSAEConfig"),
               "batchtopk": ("BatchTopKTrainingSAE", "BatchTopKTrainingSAEConfig"),
               "jumprelu": ("JumpReLUTrainingSAE", "JumpReLUTrainingSAEConfig")}
    model_cls, cfg_cls = (getattr(saes, name) for name in classes[arch])
    sae = model_cls(cfg_cls(dtype="float64", device="cpu", **settings))
    weights = load_file(state)
    sae.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    data = load_file(inputs)
    step = TrainStepInput(sae_in=data["x"].double(), coefficients=coefficients, dead_neuron_mask=data["dead_mask"].bool(),
                          n_training_steps=0, is_logging_step=False)
    result = sae.training_forward_pass(step)
    result.loss.backward()
    written = {name: value.detach().reshape(()).contiguous() for name, value in result.losses.items()}
    written["loss"] = result.loss.detach().contiguous()
    written.update({f"grad.{n}": p.grad.contiguous() for n, p in sae.named_parameters() if p.grad is not None})
    save_file(written, outputs)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"encode": encode, "loss": loss}[command](*args)
