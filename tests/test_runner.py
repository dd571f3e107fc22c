"""trainer.predict through OmniPredictionLoop: vLLM-Omni runner semantics inside Lightning."""

import json
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from conftest import random_codes, random_model
from helpers import Collector, loader, requests, trainer_kwargs
from torch.utils.data import DataLoader

from omni_lightning import (
    Code2WavModule,
    CodesDataModule,
    CodesDataset,
    LengthBucketBatchSampler,
    MultimodalOutputs,
    OmniModelRunnerOutput,
    OmniPredictionLoop,
    Trainer,
    build_pooler_output,
)


class CountingModule(Code2WavModule):
    """The real module, counting its forwards and profile runs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.forwards, self.profile_runs = 0, 0
        self.model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def profile_run(self):
        self.profile_runs += 1
        super().profile_run()


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=3)


def assert_payload_owned(wav):
    assert wav.device.type == "cpu" and wav.is_contiguous() and wav.dtype == torch.float32
    assert wav.storage_offset() == 0 and wav.untyped_storage().nbytes() == wav.nbytes


def test_predictions_equal_solo_decodes_with_runner_structure(model):
    reqs = requests()
    module = CountingModule(model=model)
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs))
    # no profiling forward: every forward decodes the data (the engine may split a batch of mixed
    # lengths into a few forwards: requests of similar lengths together)
    assert len(preds) == 3 and 3 <= module.forwards <= 6 and module.profile_runs == 1
    seen = {}
    for out in preds:
        assert isinstance(out, OmniModelRunnerOutput)
        assert out.req_id_to_index == {r: i for i, r in enumerate(out.req_ids)}
        assert out.sampled_token_ids == [[] for _ in out.req_ids] and out.logprobs is None
        assert len(out.pooler_output) == len(out.req_ids)
        for req_id, payload in zip(out.req_ids, out.pooler_output):
            assert set(payload) == {"model_outputs", "sr"} and payload["sr"] == 24000
            assert_payload_owned(payload["model_outputs"])
            seen[req_id] = payload["model_outputs"]
    assert sorted(seen) == sorted(reqs)
    with torch.inference_mode():
        for req_id, codes in reqs.items():
            alone = model(codes[None])[0]
            assert seen[req_id].shape == (1, model.output_length(codes.shape[-1]))
            assert (seen[req_id] - alone).abs().max() <= 1e-5


def test_train_mode_restored_and_stock_trainer_takes_the_loop(model):
    module = CountingModule(model=model)
    module.train()
    trainer = pl.Trainer(**trainer_kwargs())
    trainer.predict_loop = OmniPredictionLoop(trainer)
    preds = trainer.predict(module, loader(requests([5, 6])))
    assert module.training and module.model.training
    assert isinstance(preds[0], OmniModelRunnerOutput) and module.profile_runs == 1
    module.eval()
    Trainer(**trainer_kwargs()).predict(module, loader(requests([5])))
    assert not module.training
    model.eval()


def test_multiple_dataloaders(model):
    module = CountingModule(model=model)
    a, b = requests([3, 8, 2]), requests([11, 4], seed=50)
    preds = Trainer(**trainer_kwargs()).predict(module, [loader(a, 2), loader(b, 2)])
    assert len(preds) == 2 and [len(p) for p in preds] == [2, 1]
    assert sorted(r for out in preds[0] for r in out.req_ids) == sorted(a)
    assert sorted(r for out in preds[1] for r in out.req_ids) == sorted(b)
    assert module.forwards == 3


@pytest.mark.parametrize("kind", ["mappings", "datasets"])
def test_a_list_of_in_memory_sources_is_one_dataloader_each(model, kind):
    """As a list of paths is: each source its own dataloader (a list of tensors stays one source)."""
    a, b = requests([3, 8], seed=1), requests([5], seed=2)
    sources = [a, b] if kind == "mappings" else [CodesDataset(a, model.config), CodesDataset(b, model.config)]
    data = CodesDataModule(predict=sources, batch_size=4)
    preds = Trainer(**trainer_kwargs()).predict(Code2WavModule(model=model), datamodule=data)
    assert [sorted(r for out in p for r in out.req_ids) for p in preds] == [sorted(a), sorted(b)]
    assert all(not out.errors for p in preds for out in p)


@pytest.mark.parametrize("interval", ["batch", "epoch"])
def test_writer_without_return_predictions(model, interval):
    reqs = requests()
    writer = Collector(interval)
    trainer = Trainer(**trainer_kwargs(callbacks=[writer]))
    assert trainer.predict(Code2WavModule(model=model), loader(reqs), return_predictions=False) is None
    ids = list(reqs)
    if interval == "batch":
        assert [b[0] for b in writer.batches] == [[0, 1, 2], [3, 4, 5], [6]]
        assert [r for b in writer.batches for r in b[1]] == ids
        assert all(p["model_outputs"].shape[-1] > 0 for b in writer.batches for p in b[2])
    else:
        predictions, indices = writer.epoch
        assert indices == [[[0, 1, 2], [3, 4, 5], [6]]]
        # Lightning's own shapes: predictions flat for one dataloader, indices per dataloader
        assert [r for out in predictions for r in out.req_ids] == ids
        assert not any(out.in_flight for out in predictions)


def test_long_requests_are_decoded_in_chunks_and_equal_their_whole_decode(model):
    reqs = requests([40, 6])
    module = Code2WavModule(model=model, frames_per_forward=16)
    (out,) = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 2))
    wav = out.pooler_output[out.req_id_to_index["utt00"]]["model_outputs"]
    with torch.inference_mode():
        want = model(reqs["utt00"][None])[0]
    assert module.engine.frames_per_forward == 16  # so the 40-frame request took several forwards
    assert wav.shape == (1, model.output_length(40)) and (wav - want).abs().max() <= 1e-5


def test_bad_manifest_raise_stops_before_compute(tmp_path, model):
    manifest = write_manifest(tmp_path)
    with pytest.raises(ValueError) as err:
        CodesDataModule(predict=str(manifest), on_bad_input="raise", batch_size=2).setup("predict")
    msg = str(err.value)
    assert "3 bad request(s)" in msg
    assert "missing: codes file" in msg and "does not exist" in msg
    assert "range: request 'range': code 5000 at codebook 2, frame 1" in msg
    assert "corrupt: codes file" in msg and "could not be read" in msg
    skipped = CodesDataset(str(manifest), "tiny", on_bad_input="skip").bad  # the same reasons in both modes
    assert all(f"  {req_id}: {reason}" in msg for req_id, reason in skipped.items())
    module = CountingModule(model=model)
    dm = CodesDataModule(predict=str(manifest), on_bad_input="raise", batch_size=2)
    with pytest.raises(ValueError, match="bad request"):
        Trainer(**trainer_kwargs()).predict(module, datamodule=dm)
    assert module.forwards == 0


def test_bad_manifest_skip_predicts_the_rest_and_reports_each(tmp_path, model):
    manifest = write_manifest(tmp_path)
    module = CountingModule(model=model)
    dm = CodesDataModule(predict=str(manifest), on_bad_input="skip", batch_size=2)
    preds = Trainer(**trainer_kwargs()).predict(module, datamodule=dm)
    done = {r: out.pooler_output[i]["model_outputs"] for out in preds for i, r in enumerate(out.req_ids)}
    errors = {k: v for out in preds for k, v in out.errors.items()}
    assert sorted(done) == ["good1", "good2"]
    assert sorted(errors) == ["corrupt", "missing", "range"]
    assert "does not exist" in errors["missing"] and "code 5000" in errors["range"]
    assert done["good2"].shape == (1, model.output_length(7))


def write_manifest(folder):
    (folder / "codes").mkdir()
    rows = []
    for name, n in (("good1", 5), ("good2", 7), ("range", 4)):
        codes = random_codes(1, n, seed=n)[0].numpy()
        if name == "range":
            codes[2, 1] = 5000
        np.save(folder / "codes" / f"{name}.npy", codes)
        rows.append({"id": name, "codes": f"codes/{name}.npy"})
    (folder / "codes" / "corrupt.npy").write_bytes(b"not numpy at all")
    rows += [{"id": "corrupt", "codes": "codes/corrupt.npy"}, {"id": "missing", "codes": "codes/nope.npy"}]
    manifest = folder / "manifest.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return manifest


def test_length_bucketing_cuts_padding_deterministically():
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(1, 20, (100,), generator=gen)]
    lengths[::10] = [300] * 10  # skewed: a few long requests among many short ones

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    sequential = [list(range(i, min(i + 8, 100))) for i in range(0, 100, 8)]
    bucketed = list(LengthBucketBatchSampler(range(100), 8, lengths=lengths))
    assert sorted(i for b in bucketed for i in b) == list(range(100))
    assert padded(bucketed) < 0.5 * padded(sequential)
    assert bucketed == list(LengthBucketBatchSampler(range(100), 8, lengths=lengths))
    capped = list(LengthBucketBatchSampler(range(100), 8, lengths=lengths, max_frames=600))
    assert all(len(b) * max(lengths[i] for i in b) <= 600 for b in capped)
    shuffled = LengthBucketBatchSampler(range(100), 8, lengths=lengths, shuffle=True, seed=1)
    first = list(shuffled)
    shuffled.set_epoch(1)
    assert sorted(map(tuple, first)) == sorted(map(tuple, bucketed)) and first != list(shuffled)


def test_pooler_output_splitting_rules():
    batch = torch.arange(12.0).view(3, 4)
    shared = torch.ones(2)
    mm = {
        "model_outputs": [batch[0, :2], None, batch[2]],
        "per_row": batch,
        "nested": {"emb": [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)], "tag": "x"},
        "shared": shared,
        "sr": 24000,
        "meta": {"lang": ["en", "de"]},
    }
    out = build_pooler_output(mm, 3)
    assert [p["sr"] for p in out] == [24000] * 3
    assert torch.equal(out[0]["model_outputs"], torch.tensor([0.0, 1.0])) and out[1]["model_outputs"] is None
    assert torch.equal(out[1]["per_row"], torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert [float(p["nested"]["emb"]) for p in out] == [0.0, 1.0, 2.0] and out[2]["nested"]["tag"] == "x"
    assert out[0]["meta"] == {"lang": ["en", "de"]} and out[0]["meta"] is not out[1]["meta"]
    for p in out:
        for t in (p["per_row"], p["shared"]):
            inputs = (batch.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr())
            assert t.untyped_storage().data_ptr() not in inputs
    assert out[0]["shared"].untyped_storage().data_ptr() != out[1]["shared"].untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="must be a dict"):
        build_pooler_output([batch], 3)


def test_trainer_adds_the_async_copy_callback_once():
    from omni_lightning import AsyncD2HCallback

    assert sum(isinstance(c, AsyncD2HCallback) for c in Trainer(**trainer_kwargs()).callbacks) == 1
    mine = AsyncD2HCallback()
    assert [c for c in Trainer(**trainer_kwargs(callbacks=[mine])).callbacks if isinstance(c, AsyncD2HCallback)] == [
        mine
    ]
    assert not any(isinstance(c, AsyncD2HCallback) for c in Trainer(**trainer_kwargs(), async_d2h=False).callbacks)


def test_bad_loop_configuration():
    for bad in (1.5, 0, -0.1, "0.5", True, float("nan")):  # each named in the error
        with pytest.raises(ValueError, match=rf"gpu_memory_utilization .*got {re.escape(repr(bad))}"):
            Trainer(**trainer_kwargs(), gpu_memory_utilization=bad)


def test_only_multimodal_outputs_get_runner_semantics(model):
    """The rule: a ``MultimodalOutputs`` becomes an OmniModelRunnerOutput with the batch's ids; a plain dict,
    even one shaped like ours, or a tensor from the same module passes through as on a stock trainer."""

    class Step(Code2WavModule):
        def __init__(self, kind, **kw):
            super().__init__(**kw)
            self.kind = kind

        def predict_step(self, batch, batch_idx):
            assert "predict_step" not in vars(self.trainer.strategy)  # the strategy's own step, not a patch
            out = {"model_outputs": self.decode_batch(batch), "sr": self.config.sample_rate}
            if self.kind == "multimodal":
                return MultimodalOutputs(out)
            return out if self.kind == "dict" else out["model_outputs"][0]

    reqs = requests([3, 5])
    (runner,) = Trainer(**trainer_kwargs()).predict(Step("multimodal", model=model), loader(reqs, 2))
    assert isinstance(runner, OmniModelRunnerOutput) and runner.req_ids == ["utt00", "utt01"]
    with torch.inference_mode():
        want = model(reqs["utt01"][None])[0]
    assert (runner.pooler_output[1]["model_outputs"] - want).abs().max() <= 1e-5
    (as_dict,) = Trainer(**trainer_kwargs()).predict(Step("dict", model=model), loader(reqs, 2))
    assert type(as_dict) is dict and as_dict["sr"] == 24000 and len(as_dict["model_outputs"]) == 2
    (tensor,) = Trainer(**trainer_kwargs()).predict(Step("tensor", model=model), loader(requests([3]), 2))
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (1, model.output_length(3))


class Embedder(pl.LightningModule):
    """Any user's module: batches ``{"x": Float[B, 4], "req_ids", "errors"}``, one embedding row per request."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def predict_step(self, batch, batch_idx):
        return MultimodalOutputs(emb=self.layer(batch["x"]), tag="v1")


def test_a_users_module_gets_runner_outputs_with_the_ids_and_errors_of_its_step_batch():
    rows = torch.arange(20.0).view(5, 4)
    batches = [
        {"x": rows[:3], "req_ids": ["a", "b", "c"], "errors": {"bad": "no codes"}},
        {"x": rows[3:], "req_ids": ["d", "e"]},
    ]
    net, writer = Embedder(), Collector("batch")
    preds = Trainer(**trainer_kwargs(callbacks=[writer])).predict(net, DataLoader(batches, batch_size=None))
    assert [p.req_ids for p in preds] == [["a", "b", "c"], ["d", "e"]]
    assert [p.errors for p in preds] == [{"bad": "no codes"}, {}]
    assert [ids for _, ids, _ in writer.batches] == [["a", "b", "c"], ["d", "e"]]  # the hooks saw runner outputs
    with torch.no_grad():
        want = net.layer(rows)
    got = torch.stack([payload["emb"] for p in preds for payload in p.pooler_output])
    assert torch.equal(got, want) and {payload["tag"] for p in preds for payload in p.pooler_output} == {"v1"}


def test_dataloader_iter_step_with_multimodal_outputs(model):
    """A ``predict_step(dataloader_iter)`` returning MultimodalOutputs gets the ids of the batch it pulled
    last (the one Lightning's batch-end hooks receive)."""

    class IterStep(Code2WavModule):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.steps, self.hook_batches = 0, []

        def predict_step(self, dataloader_iter):
            self.steps += 1
            pulled = [next(dataloader_iter) for _ in range(2 if self.steps == 1 else 1)]
            assert dataloader_iter.length == 3  # Lightning's iterator's attributes stay readable
            batch, batch_idx, dataloader_idx = pulled[-1]
            batch = self.on_before_batch_transfer(batch, dataloader_idx)
            return MultimodalOutputs(model_outputs=self.decode_batch(batch), sr=self.config.sample_rate)

        def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            self.hook_batches.append((batch_idx, list(batch["req_ids"])))

    reqs = requests([4, 2, 6, 3, 5])
    module = IterStep(model=model)
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 2))
    assert [out.req_ids for out in preds] == [["utt02", "utt03"], ["utt04"]]
    assert module.hook_batches == [(1, ["utt02", "utt03"]), (2, ["utt04"])]
    with torch.inference_mode():
        want = model(reqs["utt04"][None])[0]
    assert torch.allclose(preds[1].pooler_output[0]["model_outputs"], want, atol=1e-5)


def test_plain_tensor_batches_get_generated_ids(model):
    """Ids ``"<batch_idx>-<i>"``, with the dataloader's index in front past the first dataloader."""
    codes = random_codes(3, 6, seed=9)
    dataloaders = [DataLoader([codes[0], codes[1]], 2), DataLoader([codes[2]], 1)]
    module = Code2WavModule(model=model)
    first, second = Trainer(**trainer_kwargs()).predict(module, dataloaders)
    assert [out.req_ids for out in first + second] == [["0-0", "0-1"], ["1-0-0"]]
    assert first[0].pooler_output[1]["model_outputs"].shape == (1, model.output_length(6))
    # called by hand, outside any trainer, the step returns the same runner output
    out = module.predict_step({"codes": codes[:2], "req_ids": ["x", "y"]}).finalize()
    by_hand = out.pooler_output[0]["model_outputs"]
    assert out.req_ids == ["x", "y"] and torch.equal(by_hand, first[0].pooler_output[0]["model_outputs"])


@pytest.mark.parametrize(
    "batch, match",
    [
        ({"codes": [[1] * 16], "req_ids": ["a"]}, "codes must be a torch.Tensor"),
        ({"codes": random_codes(2, 6), "req_ids": ["a"]}, "1 request ids for a batch of 2 requests"),
    ],
)
def test_a_bad_hand_made_batch_is_named_before_any_decode(model, batch, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**trainer_kwargs()).predict(Code2WavModule(model=model), DataLoader([batch], batch_size=None))


def test_loader_workers_only_for_data_read_from_files(tmp_path):
    from lightning.fabric.utilities.data import suggested_max_num_workers

    reqs = requests()
    in_memory = CodesDataModule(predict=reqs, config="tiny")
    in_memory.setup("predict")
    assert in_memory.predict_dataloader()[0].num_workers == 0  # nothing to read: no fork, no shared-memory copies
    for name, codes in reqs.items():
        np.save(tmp_path / f"{name}.npy", codes.numpy())
    files = CodesDataModule(predict=str(tmp_path), config="tiny")
    files.setup("predict")
    suggested = suggested_max_num_workers(1)
    assert files.predict_dataloader()[0].num_workers == (0 if suggested <= 1 else min(suggested, 4))
    chosen = CodesDataModule(predict=reqs, config="tiny", num_workers=2)
    chosen.setup("predict")
    assert chosen.predict_dataloader()[0].num_workers == 2


def test_unreadable_code_files_fail_with_one_line_reasons(tmp_path, model):
    """A numpy array pickled by torch.save, a text file named .safetensors, a 0-d array: each request
    fails alone, its reason one line naming the file and the fix (no pickle essay, no MemoryError)."""
    torch.save(np.zeros((16, 4), np.int64), tmp_path / "pickled.pt")
    (tmp_path / "text.safetensors").write_text("hello")
    np.save(tmp_path / "scalar.npy", np.int64(3))
    np.save(tmp_path / "good.npy", random_codes(1, 4)[0].numpy())
    data = CodesDataModule(predict=str(tmp_path), on_bad_input="skip", batch_size=4)
    preds = Trainer(**trainer_kwargs()).predict(Code2WavModule(model=model), datamodule=data)
    assert [r for out in preds for r in out.req_ids] == ["good"]
    reasons = {k: v for out in preds for k, v in out.errors.items()}
    assert set(reasons) == {"pickled", "text", "scalar"}
    assert all("\n" not in r and len(r) <= 300 for r in reasons.values()), reasons
    assert "a numpy array saved with torch.save?" in reasons["pickled"]
    assert "header length" in reasons["text"] and "runs past the file's 5 bytes" in reasons["text"]
    assert "got ()" in reasons["scalar"]


def test_a_manifest_saved_with_a_byte_order_mark_is_read(tmp_path, model):
    """Editors on Windows save UTF-8 with a BOM: its first line is still a request."""
    manifest = write_manifest(tmp_path)
    manifest.write_bytes(b"\xef\xbb\xbf" + manifest.read_bytes())
    ds = CodesDataset(str(manifest), "tiny", on_bad_input="skip")
    assert ds.ids[:2] == ["good1", "good2"]


def test_a_predicts_memory_cap_is_lifted_when_it_ends():
    """The cap holds during predict only: the share the process had before comes back after, so a
    later fit or uncapped predict is not held to it (torch.cuda stands in here; test_gpu_predict.py
    checks the real one)."""
    from omni_lightning.runner.loop import cap_memory

    class StandInCuda:
        def __init__(self):
            self.fraction, self.calls = 0.5, []

        def get_per_process_memory_fraction(self, device):
            return self.fraction

        def set_per_process_memory_fraction(self, fraction, device):
            self.fraction = fraction
            self.calls.append((fraction, device))

    cuda = StandInCuda()
    uncap = cap_memory("cuda:0", 0.03, cuda)
    assert cuda.fraction == 0.03
    uncap()
    assert cuda.fraction == 0.5 and cuda.calls == [(0.03, "cuda:0"), (0.5, "cuda:0")]
    old = StandInCuda()
    del StandInCuda.get_per_process_memory_fraction  # a torch that cannot read the share: back to all of it
    cap_memory("cuda:0", 0.1, old)()
    assert old.fraction == 1.0
