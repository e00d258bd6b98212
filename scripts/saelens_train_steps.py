"""SAELens's own trainer, one step at a time on request: the SAELens side of the training benchmark
(scripts/bench_sae.py). Run by the SAELens virtualenv's Python (scripts/saelens_oracle.sh), never imported:
SAELens 6 needs transformer-lens < 4, which probe's environment cannot have.

    python saelens_train_steps.py SETTINGS_JSON INPUTS
        SETTINGS_JSON: {"saes": {"topk": {"d_sae": .., "k": ..}, "standard": {"d_sae": .., "l1_coefficient": ..}},
        "batch": .., "lr": .., "threads": ..}; INPUTS: a safetensors file holding x [rows d_in], served in order,
        `batch` rows at a time, cycled.

Each dictionary's `SAETrainer.fit()` runs as SAELens runs it, in a thread of its own, on a data provider that
waits for a request: the driver prints `ready` once every trainer has asked for its first batch (start-up
done, one import of SAELens for all), and for every line `step NAME` it reads hands that trainer one batch
and prints `done` when the trainer asks for the next, so the time from `step` to `done` is one whole step of
SAELens's loop (forward, backward, clipping, Adam, its dead-feature and sparsity book-keeping). Only one
trainer steps at a time. EOF ends it. (scripts/bench_sae.py sets TQDM_DISABLE=1: fit()'s progress bar is noise.)
"""
import json
import os
import queue
import sys
import threading

import torch
from safetensors.torch import load_file


def trainer(name: str, settings: dict, d_in: int, batch: int, lr: float, data):
    import sae_lens.saes as saes
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    if name == "topk":
        sae = saes.TopKTrainingSAE(saes.TopKTrainingSAEConfig(d_in=d_in, **settings))
    elif name == "standard":
        sae = saes.StandardTrainingSAE(saes.StandardTrainingSAEConfig(d_in=d_in, **settings))
    else:
        raise SystemExit(f"architecture {name!r}: this driver times standard and topk")
    # far more samples than any benchmark asks for, at a constant learning rate; the process ends at EOF
    cfg = SAETrainerConfig(total_training_samples=batch * 10**9, train_batch_size_samples=batch, lr=lr, lr_end=lr / 10,
                           device="cpu")
    return SAETrainer(cfg, sae, data)


def main(settings_json: str, inputs: str) -> None:
    settings = json.loads(settings_json)
    torch.set_num_threads(settings["threads"])
    torch.manual_seed(0)
    x = load_file(inputs)["x"]
    batch = settings["batch"]
    go = {name: queue.Queue() for name in settings["saes"]}
    asked = queue.Queue()

    def batches(name):
        start = 0
        while True:
            asked.put(name)  # start-up, or the step before, is done
            go[name].get()
            if start + batch > x.shape[0]:
                start = 0
            yield x[start:start + batch]
            start += batch

    def run(name, sae_settings):
        try:
            trainer(name, sae_settings, x.shape[1], batch, settings["lr"], batches(name)).fit()
        except BaseException as err:
            print(f"error {name}: {type(err).__name__}: {err}", flush=True)
            os._exit(1)

    for name, sae_settings in settings["saes"].items():
        threading.Thread(target=run, args=(name, sae_settings), daemon=True).start()
        asked.get()  # one at a time: two trainers building at once would only compete for the cores
    print("ready", flush=True)
    for line in sys.stdin:
        name = line.split()[1]
        go[name].put(None)
        asked.get()
        print("done", flush=True)
    os._exit(0)  # no final save, no clean-up worth waiting for


if __name__ == "__main__":
    main(*sys.argv[1:])
