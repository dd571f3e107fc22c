"""Fit's CUDA graphs of the generator (``training/step_graph.py``): when they are used, what they replay,
and what happens when the weights move, the shape changes or a capture fails.

On the CPU the capture is a stand-in (:class:`EagerCapture`) whose "replay" runs the captured forward
eagerly after checking that the weights sit where they sat at capture, which is what a real graph
needs; everything around it (the policy, ``BoundWeights``, the fallback, the module's wiring through
real Lightning fits) is the code that runs on CUDA. The CUDA tests run the real capture.
"""

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import random_codes, random_model, trainer_kwargs
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from omni_lightning import Code2WavModule, CodesDataModule, Trainer
from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.kernels import Kernels
from omni_lightning.training.step_graph import TrainingGraph, thread_local_graphs, training_graphs_allowed

cuda = pytest.mark.gpu


class EagerCapture:
    """Stand-in for ``cuda_capture``: records each capture; a replay checks the weights' addresses
    against the capture's, then runs the forward eagerly. ``fail``: the capture raises it instead."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.captures, self.replays = fail, [], 0

    def __call__(self, forward, sample_args):
        if self.fail is not None:
            raise self.fail
        ptrs = [t.data_ptr() for t in forward.parameters()]
        self.captures.append(tuple(sample_args[0].shape))

        def replay(codes):
            assert [t.data_ptr() for t in forward.parameters()] == ptrs, "a graph would read moved weights"
            assert codes.shape == sample_args[0].shape
            self.replays += 1
            return forward(codes)

        return replay


class Graphed(Code2WavModule):
    """The module with the stand-in capture in place of CUDA's (its default is eager on the CPU)."""

    def __init__(self, capture, **kw):
        torch.manual_seed(0)  # the discriminators' initial weights
        super().__init__(model=random_model("tiny", seed=7), learning_rate=3e-3, **kw)
        self.capture = capture

    def configure_training_graph(self, trainer):
        return TrainingGraph(self.capture) if self.capture is not None else None


@pytest.fixture(scope="module")
def long_pairs(tmp_path_factory):
    """Six pairs of 2.0-2.5 s: with 20-frame crops every full batch has one shape."""
    folder = tmp_path_factory.mktemp("graph_pairs")
    return make_demo_data(folder, 6, 2.0, 2.5, teacher=make_teacher("tiny"), seed=3, name="train.jsonl")


def fit(module, pairs, steps, batch_size=2, callbacks=(), **kw):
    pl.seed_everything(0, verbose=False)
    data = CodesDataModule(train=str(pairs), batch_size=batch_size, crop_frames=20)
    trainer = Trainer(**{**trainer_kwargs(max_steps=steps, num_sanity_val_steps=0, callbacks=list(callbacks)), **kw})
    graph = {}
    trainer.callbacks.append(KeepGraph(graph))
    trainer.fit(module, datamodule=data)
    return graph.get("graph")


class KeepGraph(pl.Callback):
    """Keeps the fit's graph object (fit's teardown frees it from the module)."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        self.out["graph"] = pl_module.training_graph


def weights(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize("adversarial", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["rec", "gan"])
def test_fit_replays_one_shape_and_trains_as_the_eager_fit_does(long_pairs, adversarial):
    capture = EagerCapture()
    graphed, eager = Graphed(capture, adversarial=adversarial), Graphed(None, adversarial=adversarial)
    graph = fit(graphed, long_pairs, 5)  # 5 batches, the GAN's too
    fit(eager, long_pairs, 5)
    # batch 1 eager (a shape seen once), batch 2 captured, 3-5 replayed; the batches of 3 (epoch 1) and
    # of the second epoch all have the crop's shape
    assert capture.captures == [(2, 16, 20)] and capture.replays == 4
    assert graph.stats["captures"] == 1 and graph.stats["replays"] == 4 and graph.stats["eager"] == 1
    assert graphed.training_graph is None  # freed at the end of fit
    expected = weights(eager)
    assert all(torch.equal(p, expected[n]) for n, p in weights(graphed).items())


class MoveWeights(pl.Callback):
    """Before batch 4, every parameter gets new storage (as a round trip to the host would give)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 3 or trainer.global_step == 3:
            for p in pl_module.model.parameters():
                p.data = p.data.clone()


def test_moved_weights_are_copied_back_where_the_graph_reads_them(long_pairs):
    capture = EagerCapture()
    graphed, eager = Graphed(capture), Graphed(None)
    graph = fit(graphed, long_pairs, 5, callbacks=[MoveWeights()])
    fit(eager, long_pairs, 5, callbacks=[MoveWeights()])
    assert capture.replays == 4 and graph.stats["captures"] == 1  # replayed on, not captured again
    expected = weights(eager)
    assert all(torch.equal(p, expected[n]) for n, p in weights(graphed).items())


def test_a_failed_capture_warns_once_and_the_fit_finishes_eagerly(long_pairs, caplog):
    capture = EagerCapture(fail=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    graphed, eager = Graphed(capture), Graphed(None)
    with caplog.at_level(logging.WARNING, logger="omni_lightning.training.step_graph"):
        graph = fit(graphed, long_pairs, 5)
    fit(eager, long_pairs, 5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "omni_lightning.training.step_graph"]
    assert len(warnings) == 1 and "OutOfMemoryError: CUDA out of memory" in warnings[0], warnings
    assert "[2, 16, 20]" in warnings[0] and graph.failed and graph.stats["eager"] == 5
    expected = weights(eager)
    assert all(torch.equal(p, expected[n]) for n, p in weights(graphed).items())


def test_shapes_grad_mode_dtype_and_trainable_set_decide_what_replays():
    model = random_model("tiny", seed=1).train()
    capture = EagerCapture()
    graph, kernels = TrainingGraph(capture), Kernels()
    a, b = random_codes(2, 9, seed=1), random_codes(3, 9, seed=2)
    for codes in (a, b, a, b):  # never twice in a row: eager
        graph(model, codes, kernels)
    assert capture.captures == []
    graph(model, b, kernels)  # b twice in a row: captured (and replayed)
    graph(model, a, kernels)  # a once: eager, b's graph kept
    graph(model, b, kernels)
    with torch.no_grad():
        graph(model, b, kernels)  # validation: no grad, eager
    assert capture.captures == [(3, 16, 9)] and graph.stats["replays"] == 2 and graph.stats["eager"] == 6
    model.code_embedding.weight.requires_grad_(False)  # a new trainable set: a new key, captured anew
    graph(model, a, kernels)
    graph(model, a, kernels)
    assert capture.captures == [(3, 16, 9), (2, 16, 9)]  # replaced
    model.double()  # the layout the graph reads is gone: dropped and captured anew (a repeated key)
    out = graph(model, a, kernels)
    assert out.dtype == torch.float64 and len(capture.captures) == 3 and graph.stats["replays"] == 4


def test_shapes_that_keep_changing_stop_being_captured_after_max_captures(caplog):
    model = random_model("tiny", seed=1).train()
    capture = EagerCapture()
    graph, kernels = TrainingGraph(capture, max_captures=2), Kernels()
    shapes = [random_codes(b, 9, seed=b) for b in (1, 1, 2, 2, 3, 3, 1, 1)]
    with caplog.at_level(logging.INFO, logger="omni_lightning.training.step_graph"):
        for codes in shapes:
            graph(model, codes, kernels)
    assert capture.captures == [(1, 16, 9), (2, 16, 9)] and graph.capped  # 3 and the return to 1: eager
    assert sum("keep changing" in r.getMessage() for r in caplog.records) == 1
    assert graph.stats["eager"] == 6 and graph.stats["replays"] == 2


def test_graphs_are_allowed_on_cuda_with_a_plain_precision_or_bf16_mixed_one_process_no_accumulation(long_pairs):
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for plugin in (Precision(), HalfPrecision("bf16-true"), HalfPrecision("16-true"), DoublePrecision()):
        assert training_graphs_allowed(gpu, plugin, 1, 1)
    assert not training_graphs_allowed(cpu, Precision(), 1, 1)
    # bf16-mixed: Lightning's autocast keeps no weight cache (which could not be captured), and scales nothing
    assert training_graphs_allowed(gpu, MixedPrecision("bf16-mixed", "cuda"), 1, 1)
    assert not training_graphs_allowed(gpu, MixedPrecision("16-mixed", "cuda"), 1, 1)  # a scaled backward
    assert not training_graphs_allowed(gpu, Precision(), 2, 1)  # DDP: not run on several GPUs
    assert not training_graphs_allowed(gpu, Precision(), 1, 2)  # accumulation: static gradients
    assert fit(Code2WavModule(model=random_model("tiny")), long_pairs, 1) is None  # the CPU: the eager model


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def test_captures_are_thread_local_on_a_torch_whose_make_graphed_callables_lacks_the_mode():
    """torch 2.11's ``make_graphed_callables`` takes no ``capture_error_mode`` (a fit there failed
    every capture with a TypeError, then ran eagerly): its captures get ``thread_local`` through the
    ``torch.cuda.graph`` it looks up, and the stock class is back afterwards."""
    import inspect

    stock = torch.cuda.graph
    with thread_local_graphs():
        assert torch.cuda.graph is not stock and issubclass(torch.cuda.graph, stock)
        assert inspect.signature(torch.cuda.graph).parameters["capture_error_mode"].default == "thread_local"
    assert torch.cuda.graph is stock
    with pytest.raises(KeyError), thread_local_graphs():
        raise KeyError("restored on errors too")
    assert torch.cuda.graph is stock


@cuda
def test_cuda_replays_give_the_eager_gradients_at_the_moving_weights(no_tf32):
    """The real capture, fp32 (TF32 off): at every step the replayed forward and backward give the
    gradients an eager pass gives at the same weights, while Adam moves the weights in place between
    steps (by ~1e-3 each: a graph reading stale weights would miss by far more). Step 1 runs eagerly, step 2 captures,
    3-5 replay. A whole fit is not compared: a graphed and an eager CUDA fit parted by
    step 2-4 (AdamW amplifies the backward's run-to-run rounding where a gradient is near zero)."""
    dev = torch.device("cuda")
    model = random_model("tiny", seed=7).to(dev)
    kernels, graph = Kernels.for_training(dev), TrainingGraph()
    params = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.Adam(params, lr=1e-3)  # (SGD at 1e-3 saturated the output: zero gradients by step 3)
    gen = torch.Generator(device=dev).manual_seed(0)
    for step in range(1, 6):
        codes = random_codes(2, 20, seed=step).to(dev)
        r = torch.randn(2, 1, model.config.output_length(20), device=dev, generator=gen)
        expected = torch.autograd.grad((model(codes, kernels=kernels) * r).sum(), params)
        adam.zero_grad(set_to_none=True)
        (graph(model, codes, kernels) * r).sum().backward()
        ours = torch.cat([p.grad.flatten() for p in params])
        want = torch.cat([g.flatten() for g in expected])
        assert want.norm() > 0 and float((ours - want).norm() / want.norm()) <= 1e-5, step
        adam.step()
    assert graph.failed is None and graph.stats["captures"] == 1 and graph.stats["replays"] == 4


@cuda
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("adversarial", [False, True], ids=["rec", "gan"])
def test_cuda_bf16_fit_replays_then_predicts_in_place(long_pairs, adversarial, precision):
    module = Graphed(capture=None, adversarial=adversarial)
    module.configure_training_graph = Code2WavModule.configure_training_graph.__get__(module)  # the default
    losses = Losses()
    graph = fit(module, long_pairs, 5, callbacks=[losses], accelerator="gpu",
                precision=precision)  # fmt: skip
    assert graph.failed is None and graph.stats["captures"] == 1 and graph.stats["replays"] == 4
    assert all(torch.isfinite(torch.tensor(losses.losses)))
    trainer = Trainer(**{**trainer_kwargs(), "accelerator": "gpu", "precision": precision})
    out = trainer.predict(module, datamodule=CodesDataModule(predict=str(long_pairs), batch_size=3))
    waves = [p["model_outputs"] for o in out for p in o.pooler_output]
    assert len(waves) == 6 and all(torch.isfinite(w).all() for w in waves)
