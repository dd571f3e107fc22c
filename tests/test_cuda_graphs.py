"""CUDAGraphDecoder's buckets, static buffers, trimming and fallbacks, on the CPU.

Only ``torch.cuda.graph`` is replaced: ``RecordingCapture`` records the forward and "replays" it
into the same static output buffer, as a graph would. Everything else (bucket choice, padding into
the static input, stale pad rows and frames, trimming, owned outputs, eager fallback, refresh) is
the real code, through real decodes and a real Lightning trainer.
"""

import random

import pytest
import torch
from conftest import micro_config, random_codes, random_model
from helpers import loader, requests, trainer_kwargs

from omni_lightning import Code2WavModule, Trainer
from omni_lightning.models.cuda_graphs import CUDAGraphDecoder, ShapeBuckets

BUCKETS = ShapeBuckets(frames=(8, 16, 24), batches=(1, 2, 4), max_elements=4 * 24)


class RecordingCapture:
    def __init__(self):
        self.recorded = []

    def __call__(self, fn):
        out = fn()
        self.recorded.append(fn)
        return (lambda: out.copy_(fn())), out


class OutOfMemoryCapture:
    def __call__(self, fn):
        raise torch.OutOfMemoryError("stand-in: no memory for this graph")


@pytest.fixture(scope="module")
def model():
    return random_model(micro_config(), seed=9)


def solo(model, codes, n):
    with torch.inference_mode():
        return model(codes[None, :, :n])[0]


def test_random_batches_equal_solo_decodes_with_bounded_shapes(model):
    capture = RecordingCapture()
    graphs = CUDAGraphDecoder(model, BUCKETS, capture=capture)
    rng = random.Random(0)
    for step in range(5):
        batch = rng.randint(1, 4)
        lengths = [rng.randint(1, 24) for _ in range(batch)]
        codes = random_codes(batch, max(lengths), model.config, seed=step)
        for i, n in enumerate(lengths):
            codes[i, :, n:] = -1  # pad frames may hold anything: they are never looked up
        with torch.inference_mode():
            wavs = model.decode(codes, lengths, forward=graphs)
        for i, n in enumerate(lengths):
            assert wavs[i].shape == (1, model.output_length(n))
            assert (wavs[i] - solo(model, codes[i], n)).abs().max() <= 1e-5
    stats = graphs.stats
    assert stats.captures == len(graphs.graphs) == len(stats.shapes) == len(capture.recorded)
    assert stats.captures <= len(BUCKETS.frames) * len(BUCKETS.batches)
    assert stats.replays >= 1 and stats.eager == 0
    for batch, frames in graphs.graphs:
        assert (batch, 24) in graphs.graphs  # each batch size captured its largest bucket first
        assert graphs.graphs[batch, frames].codes.shape == (batch, model.config.num_quantizers, frames)


def _cost(buckets, lengths, groups):
    keys = [buckets.bucket(len(g), max(lengths[i] for i in g)) for g in groups]
    return sum(buckets.group_cost + (k[0] * k[1] if k else 2 * len(g) * max(lengths[i] for i in g))
               for k, g in zip(keys, groups))  # fmt: skip


def test_plan_splits_mixed_batches_into_runs_of_similar_length():
    buckets = ShapeBuckets(frames=(8, 16, 24), batches=(1, 2, 4), max_elements=4 * 24, group_cost=8)
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.randint(1, 24) for _ in range(rng.randint(1, 9))]
        groups = buckets.plan(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each row once
        assert all(g == sorted(g) for g in groups)  # batch order inside a group
        for a, b in zip(groups, groups[1:]):  # runs of the length-sorted rows
            assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)
        assert _cost(buckets, lengths, groups) <= _cost(buckets, lengths, [list(range(len(lengths)))])
    # short and long rows apart; one length stays together; 5 rows (no bucket) become graphable groups
    assert buckets.plan([2, 24, 3, 23]) == [[0, 2], [1, 3]]
    assert buckets.plan([9] * 4) == [[0, 1, 2, 3]]
    assert all(buckets.bucket(len(g), 9) for g in buckets.plan([9] * 5))
    # a replay costing more than any padding: never split what one bucket holds
    assert ShapeBuckets(frames=(8, 16, 24), batches=(1, 2, 4), group_cost=10**6).plan([2, 24, 3]) == [[0, 1, 2]]


def test_mixed_batches_run_in_groups_and_equal_solo_decodes(model):
    buckets = ShapeBuckets(frames=(8, 16, 24), batches=(1, 2, 4), max_elements=4 * 24, group_cost=8)
    graphs = CUDAGraphDecoder(model, buckets, capture=RecordingCapture())
    lengths = [3, 22, 5, 24, 20, 2]  # unsorted, and more rows than the largest batch bucket
    codes = random_codes(len(lengths), 24, model.config, seed=11).to(torch.int32)
    for i, n in enumerate(lengths):
        codes[i, :, n:] = -1
    with torch.inference_mode():
        wavs = model.decode(codes, lengths, forward=graphs)
        again = model.decode(codes, lengths, forward=graphs)  # replays
    assert graphs.stats.eager == 0 and graphs.stats.replays >= 2
    assert any(frames == 8 for _, frames in graphs.stats.shapes)  # the short rows ran apart, unpadded to 24
    for i, n in enumerate(lengths):
        want = solo(model, codes[i], n)
        assert wavs[i].shape == want.shape == again[i].shape
        assert (wavs[i] - want).abs().max() <= 1e-5 and torch.equal(wavs[i], again[i])


def test_outputs_own_their_storage_across_replays(model):
    graphs = CUDAGraphDecoder(model, BUCKETS, capture=RecordingCapture())
    # the first fills its bucket (2, 16) exactly: its output is the whole static buffer
    a, b = random_codes(2, 16, model.config, seed=1), random_codes(2, 12, model.config, seed=2)
    with torch.inference_mode():
        graphs(b)  # captures
        first = graphs(a)  # replays
        kept = first.clone()
        second = graphs(b)  # replays again: the static output is overwritten
    assert graphs.stats.replays == 2 and torch.equal(first, kept)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert first.shape == (2, 1, model.output_length(16)) and second.shape == (2, 1, model.output_length(12))


def test_shapes_outside_the_buckets_run_eagerly_at_their_own_shape(model):
    graphs = CUDAGraphDecoder(model, BUCKETS, capture=RecordingCapture())
    with torch.inference_mode():
        for batch, frames in ((5, 4), (1, 30), (4, 24)):  # too many requests, too long, too many elements
            codes = random_codes(batch, frames, model.config, seed=batch)
            assert torch.equal(graphs(codes), model(codes))
    assert graphs.stats.eager == 2 and graphs.stats.captures == 1  # (4, 24) fits max_elements exactly
    with torch.enable_grad():  # graphs only without autograd
        codes = random_codes(1, 4, model.config)
        assert (graphs(codes) - model(codes)).abs().max() <= 1e-5 and graphs.stats.eager == 3


def test_a_failed_capture_leaves_the_bucket_eager(model):
    graphs = CUDAGraphDecoder(model, BUCKETS, capture=OutOfMemoryCapture())
    codes = random_codes(2, 7, model.config, seed=4)
    with torch.inference_mode():
        want = model(codes)
        assert (graphs(codes) - want).abs().max() <= 1e-5  # the warm-up's result
        assert (graphs(codes) - want).abs().max() <= 1e-5
    assert graphs.eager_buckets == {(2, 8), (2, 24)} and not graphs.graphs and graphs.stats.eager == 1


def test_refresh_puts_moved_weights_back_where_the_graphs_read_them():
    model = random_model(micro_config(), seed=10)
    graphs = CUDAGraphDecoder(model, BUCKETS, capture=RecordingCapture())
    codes = random_codes(1, 5, model.config, seed=5)
    with torch.inference_mode():
        graphs(codes)
    addresses = [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]
    # what Lightning does between predict calls: the module leaves and comes back as new tensors
    # (here with a changed weight, as after fine-tuning)
    model._apply(lambda t: t.clone())
    model.decoder[-1].conv.bias.data.add_(0.25)
    assert [t.data_ptr() for t in model.parameters()] != addresses[: len(list(model.parameters()))]
    want = model.decoder[-1].conv.bias.clone()
    assert not graphs.refresh() and len(graphs.graphs) == 2
    assert [t.data_ptr() for t in [*model.parameters(), *model.buffers()]] == addresses
    assert torch.equal(model.decoder[-1].conv.bias, want)
    with torch.inference_mode():
        assert (graphs(codes) - model(codes)).abs().max() <= 1e-5
    model.double()  # another dtype: the graphs go
    assert graphs.refresh() and not graphs.graphs
    with torch.inference_mode():
        assert graphs(codes).dtype == torch.float64 and graphs.stats.captures == 4


def test_trainer_predict_through_the_graph_decoder_equals_solo_decodes():
    model = random_model(micro_config(), seed=9)  # its own: this test changes a weight
    rng = random.Random(3)
    lengths = [rng.randint(1, 24) for _ in range(9)] + [40]  # the last one is chunked (max 24 frames)
    reqs = requests(lengths, seed=60)
    module = Code2WavModule(model=model, max_frames_per_request=24, chunk_size=16, left_context=8)
    module.graph_decoder = CUDAGraphDecoder(model, BUCKETS, capture=RecordingCapture(), out_dtype=torch.float32)
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 4))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    stats = module.graph_decoder.stats
    assert stats.captures + stats.replays >= 3 and stats.captures <= len(stats.shapes)
    for (req_id, codes), n in zip(reqs.items(), lengths):
        if n <= 24:
            want = solo(model, codes, n)
        else:
            with torch.inference_mode():
                want = model.chunked_decode(codes[None], 16, 8)
        assert got[req_id].shape == want.shape and (got[req_id] - want).abs().max() <= 1e-5
    # between predict calls Lightning moves the module away and back (new tensors; on a GPU it is
    # .cpu() then .to("cuda")); here that is a clone, with a weight changed as fine-tuning would
    captures = stats.captures
    model._apply(lambda t: t.clone())
    model.decoder[-1].conv.bias.data.add_(0.1)
    preds = Trainer(**trainer_kwargs()).predict(module, loader(reqs, 4))
    got = {r: o.pooler_output[i]["model_outputs"] for o in preds for i, r in enumerate(o.req_ids)}
    assert stats.captures == captures  # the graphs were kept, and read the new weights
    for (req_id, codes), n in zip(reqs.items(), lengths):
        if n <= 24:
            assert (got[req_id] - solo(model, codes, n)).abs().max() <= 1e-5
    # fast_path=False: the same module runs eagerly, the graph decoder untouched
    module.fast_path = False
    replays = stats.replays
    Trainer(**trainer_kwargs()).predict(module, loader(reqs, 4))
    assert stats.replays == replays
