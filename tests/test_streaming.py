"""Streaming decode: exact chunk by chunk, many streams at once, bad input refused per stream."""

import random

import pytest
import torch
from conftest import random_codes, random_model
from helpers import RecordingCapture

from omni_lightning import (
    Code2Wav,
    Code2WavConfig,
    Code2WavModule,
    CodesDataModule,
    DecodeEngine,
    StreamingDecoder,
    Trainer,
)
from omni_lightning.data.synthetic import make_demo_data, make_teacher
from omni_lightning.engine.plan import CHUNKS
from omni_lightning.models.state import ALIGN

cuda = pytest.mark.gpu

# 3 layers, one KV head, a 5-frame window (streams run far past it), other rates (12 samples/frame)
ODD = dict(name="odd", hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
           intermediate_size=32, decoder_dim=16, sliding_window=5, upsample_rates=(3, 2),
           upsampling_ratios=(2,))  # fmt: skip


@pytest.fixture(scope="module")
def odd_model() -> Code2Wav:
    return random_model(Code2WavConfig.from_name("tiny", **ODD), seed=1)


@pytest.fixture(scope="module")
def tiny() -> Code2Wav:
    return random_model("tiny", seed=2)


def chunk_sizes(frames: int, seed: int, largest: int) -> list[int]:
    """A 1-frame first chunk, then random sizes up to ``largest``, summing to ``frames``."""
    rng = random.Random(seed)
    sizes = [1]
    while sum(sizes) < frames:
        sizes.append(min(rng.randint(1, largest), frames - sum(sizes)))
    return sizes


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize(("which", "frames", "largest", "seeds"), [("tiny", 20, 8, (0, 1)), ("odd", 31, 9, (0, 1, 2))])
def test_chunks_of_any_sizes_give_exactly_decode(which, frames, largest, seeds, tiny, odd_model):
    model = tiny if which == "tiny" else odd_model
    config = model.config
    decoder = StreamingDecoder(model, max_streams=2)
    codes = random_codes(1, frames, config, seed=frames)[0]
    with torch.no_grad():
        full = model.decode(codes[None])[0]
    assert full.std() > 0.05  # a real signal
    for seed in seeds:
        sizes = chunk_sizes(frames, seed, largest)
        sid = decoder.open()
        pieces, done = [], 0
        for n in sizes:
            wav = decoder.step({sid: codes[:, done : done + n]})[sid]
            assert wav.shape == (1, config.output_length(done + n) - config.output_length(done))
            pieces.append(wav)
            done += n
        rest = decoder.close(sid)
        assert rest.shape == (1, 0)  # the look-ahead tail is not part of decode: nothing left
        assert max_diff(torch.cat(pieces, dim=-1), full) <= 1e-5, sizes


def test_each_call_computes_only_its_new_frames(odd_model):
    """A step decodes its new frames (padded at most to the next chunk bucket), never earlier ones."""
    seen = []
    hook = odd_model.code_embedding.register_forward_hook(lambda m, i, o: seen.append(i[0].clone()))
    offset = odd_model.code_offset
    try:
        decoder = StreamingDecoder(odd_model, max_streams=1)
        sid = decoder.open()
        codes = random_codes(1, 40, odd_model.config, seed=5)[0]
        for start, n in ((0, 1), (1, 3), (4, 30), (34, 6)):
            seen.clear()
            decoder.step({sid: codes[:, start : start + n]})
            rows = [x[0] - offset[0] for x in seen]  # the stream's row of each forward's codes
            assert sum(r.shape[-1] for r in rows) <= min(c for c in CHUNKS if c >= n)
            assert torch.equal(torch.cat(rows, dim=-1)[:, :n], codes[:, start : start + n])
    finally:
        hook.remove()


def test_streams_together_equal_streams_alone(odd_model):
    """Streams open and close at different steps with different chunk sizes; each is its own decode."""
    config = odd_model.config
    lengths = {"a": 17, "b": 29, "c": 8, "d": 23, "e": 12}
    opens = {"a": 0, "b": 0, "c": 1, "d": 3, "e": 4}  # "e" reuses the slot "c" frees
    codes = {sid: random_codes(1, n, config, seed=i)[0] for i, (sid, n) in enumerate(lengths.items())}
    sizes = {sid: chunk_sizes(n, seed=i, largest=7) for i, (sid, n) in enumerate(lengths.items())}
    decoder = StreamingDecoder(odd_model, max_streams=4)
    out = {sid: [] for sid in lengths}
    done = dict.fromkeys(lengths, 0)
    step = 0
    while any(done[s] < lengths[s] for s in lengths):
        for sid, at in opens.items():
            if at == step:
                decoder.open(sid)
        chunks = {}
        for sid in decoder.streams:
            if sizes[sid]:
                n = sizes[sid].pop(0)
                chunks[sid] = codes[sid][:, done[sid] : done[sid] + n]
                done[sid] += n
        for sid, wav in decoder.step(chunks).items():
            out[sid].append(wav)
        for sid in decoder.streams:
            if done[sid] == lengths[sid]:
                out[sid].append(decoder.close(sid))
        step += 1
    assert len({len(v) for v in out.values()}) > 1
    for sid, pieces in out.items():
        with torch.no_grad():
            alone = odd_model.decode(codes[sid][None])[0]
        assert max_diff(torch.cat(pieces, dim=-1), alone) <= 1e-5, sid


@pytest.mark.parametrize("graphs", [False, True])
def test_new_streams_first_chunks_of_any_size_give_exactly_decode(odd_model, graphs):
    """A new stream's first chunk, of random size, on a slot other streams used and freed, beside a
    stream mid-way or alone, many seeds: each stream's audio is ``decode`` of its codes alone. With a
    graph stand-in (the CUDA path's static inputs, on the CPU) the first chunks replay graphs captured
    in the warm-up."""
    config = odd_model.config
    decoder = StreamingDecoder(odd_model, max_streams=2, capture=RecordingCapture() if graphs else None)
    if graphs:
        decoder.warmup(chunk_sizes=[c for c in CHUNKS if c <= 12], batch_sizes=(1, 2))
    rng = random.Random(7)
    other = decoder.open("other")
    other_codes = random_codes(1, 200, config, seed=99)[0]
    other_done, other_out = 0, []
    for seed in range(16):
        codes = random_codes(1, rng.randint(2, 14), config, seed=seed)[0]
        first = rng.randint(1, min(12, codes.shape[1]))
        sid = decoder.open()
        together = seed % 2 == 0 and other_done + first <= other_codes.shape[1]
        chunks = {sid: codes[:, :first]}
        if together:  # the other stream steps beside it, at another position and chunk size
            n = rng.randint(1, 6)
            chunks[other] = other_codes[:, other_done : other_done + n]
            other_done += n
        out = decoder.step(chunks)
        if together:
            other_out.append(out[other])
        pieces = [out[sid], decoder.step({sid: codes[:, first:]})[sid], decoder.close(sid)]
        with torch.no_grad():
            alone = odd_model.decode(codes[None])[0]
        assert pieces[0].shape == (1, config.output_length(first)), (seed, first)
        assert max_diff(torch.cat(pieces, dim=-1), alone) <= 1e-5, (seed, first)
    with torch.no_grad():
        alone = odd_model.decode(other_codes[None, :, :other_done])[0]
    assert max_diff(torch.cat(other_out, dim=-1), alone) <= 1e-5  # the stream beside them, exact too
    if graphs:
        assert decoder.engine.graphs.stats.replays > 0 and decoder.engine.graphs.stats.eager == 0


def test_a_stream_does_not_see_its_batch_neighbours(odd_model):
    config = odd_model.config
    mine = random_codes(1, 12, config, seed=10)[0]
    results = []
    for neighbour_seed in (11, 12):
        other = random_codes(1, 12, config, seed=neighbour_seed)[0]
        decoder = StreamingDecoder(odd_model, max_streams=2)
        decoder.open("mine"), decoder.open("other")
        decoder.step({"other": other[:, :2]})  # the neighbour is at another position too
        wavs = [decoder.step({"mine": mine[:, i : i + 4], "other": other[:, i + 2 : i + 6]})["mine"] for i in (0, 4)]
        results.append(torch.cat(wavs, dim=-1))
    assert torch.equal(results[0], results[1])


def test_bad_chunks_raise_for_their_stream_only(odd_model):
    config = odd_model.config
    codes = {s: random_codes(1, 10, config, seed=20 + i)[0] for i, s in enumerate("ab")}
    decoder = StreamingDecoder(odd_model, max_streams=2)
    decoder.open("a"), decoder.open("b")
    out = {"a": [decoder.step({"a": codes["a"][:, :1]})["a"]], "b": []}
    bad = codes["a"][:, 1:3].clone()
    bad[2, 1] = config.codebook_size
    cases = [
        (bad, r"stream 'a': code 2048 at codebook 2, frame 2 is outside \[0, 2048\)"),
        (codes["a"][:3, 1:3], r"stream 'a': shape \(3, 2\) has 3 codebooks, this model expects 16"),
        (codes["a"][:, 1:3].float(), r"stream 'a': codes have dtype float32; codes must be integers"),
        (codes["a"][None, :, 1:3], r"stream 'a': codes must have shape \[codebooks, frames\]"),
        (codes["a"][:, 1:3].tolist(), r"stream 'a': codes must be a torch.Tensor"),
    ]
    for chunk, message in cases:
        with pytest.raises(ValueError, match=message):
            decoder.step({"b": codes["b"][:, :2], "a": chunk})
        with pytest.raises(ValueError, match=message):
            decoder.push("a", chunk)
    assert decoder.frames("a") == 1 and decoder.frames("b") == 0  # nothing of either stream changed
    with pytest.raises(ValueError, match="unknown stream 'z'"):
        decoder.step({"z": codes["a"][:, :1], "b": codes["b"][:, :2]})
    assert decoder.frames("b") == 0
    # both continue, exactly
    got = decoder.step({"a": codes["a"][:, 1:6], "b": codes["b"][:, :4]})
    out["a"].append(got["a"]), out["b"].append(got["b"])
    out["a"].append(decoder.close("a"))
    with pytest.raises(ValueError, match="stream 'a' is closed"):
        decoder.step({"a": codes["a"][:, 6:], "b": codes["b"][:, 4:]})
    out["b"].append(decoder.step({"b": codes["b"][:, 4:]})["b"])
    with torch.no_grad():
        assert max_diff(torch.cat(out["a"], -1), odd_model.decode(codes["a"][None, :, :6])[0]) <= 1e-5
        assert max_diff(torch.cat(out["b"], -1), odd_model.decode(codes["b"][None])[0]) <= 1e-5
    decoder.open("c")
    with pytest.raises(ValueError, match="all 2 stream slots of this decoder are in use"):
        decoder.open("d")
    with pytest.raises(ValueError, match="stream 'c' is already open"):
        decoder.open("c")


@pytest.mark.parametrize("share", [0.0, 1.5, -0.1])
def test_a_bad_memory_share_is_refused_naming_it(tiny, share):
    from omni_lightning import Code2WavModule

    with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], got {share}"):
        Code2WavModule(model=tiny).streaming_decoder(max_streams=2, gpu_memory_utilization=share)


def test_each_streams_samples_have_storage_of_their_own(odd_model):
    """A step copies its streams' samples out in one go, but each into its own storage: keeping one
    stream's output (a server accumulating it) never keeps the step's other rows alive."""
    decoder = StreamingDecoder(odd_model, max_streams=3)
    codes = random_codes(3, 12, odd_model.config, seed=31)
    for i in range(3):
        decoder.open(i)
    for step in (slice(0, 5), slice(5, 12)):
        out = decoder.step({i: codes[i, :, step] for i in range(3)})
        for samples in out.values():
            assert samples.untyped_storage().nbytes() == samples.numel() * samples.element_size()


def test_state_per_stream_is_bounded_and_what_the_architecture_says(odd_model):
    config = odd_model.config
    decoder = StreamingDecoder(odd_model, max_streams=1)
    # attention: K and V of window - 1 frames per layer; each causal conv: (kernel - 1) * dilation
    # input samples; each decoder block's transposed conv: its last input sample
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.sliding_window - 1) * 8
    convs = 6 * 16 + 6 * 16 + (16 + (6 + 18 + 54) * 8) + (8 + (6 + 18 + 54) * 4) + 6 * 4
    tensors = decoder.engine.state.tensors
    assert sum(t[0].numel() for t in tensors.values()) == kv + convs
    # held: those, each started on an ALIGN-element boundary of the slot's row, and the frame count (int64)
    padding = decoder.state_bytes_per_stream - (kv + convs) * 4 - 8
    assert 0 <= padding < len(tensors) * ALIGN * 4
    held = sum(t.numel() for t in decoder.engine.state.tensors.values())
    sid = decoder.open()
    codes = random_codes(1, 60, config, seed=3)[0]
    for start in range(0, 60, 6):
        decoder.step({sid: codes[:, start : start + 6]})
    assert sum(t.numel() for t in decoder.engine.state.tensors.values()) == held  # 12x the window later: same state


def test_qwen3_omni_state_per_stream():
    with torch.device("meta"):
        model = Code2Wav("qwen3-omni").to(torch.bfloat16)
    decoder = StreamingDecoder(model, max_streams=1)
    kv = 8 * 2 * 16 * 71 * 64
    convs = 2 * 6 * 1024 + 6 * 1024 + (1536 + 768 + 384 + 192) + 78 * (768 + 384 + 192 + 96) + 6 * 96
    assert decoder.state_bytes_per_stream == (kv + convs) * 2 + 8 == 2_594_952


def test_module_stream_yields_decode_in_pieces(tiny):
    module = Code2WavModule(model=tiny)
    codes = random_codes(1, 14, tiny.config, seed=7)[0]
    sizes = [1, 2, 5, 6]
    chunks = [codes[:, sum(sizes[:i]) : sum(sizes[: i + 1])].to(torch.int16) for i in range(len(sizes))]
    pieces = list(module.stream(iter(chunks)))
    assert len(pieces) == len(sizes) and all(p.dtype == torch.float32 for p in pieces)
    with torch.no_grad():
        assert max_diff(torch.cat(pieces, dim=-1), tiny.decode(codes[None])[0]) <= 1e-5
    bad = codes[:, :3].clone()
    bad[0, 0] = -1
    stream = module.stream([codes[:, :2], bad])
    next(stream)
    with pytest.raises(ValueError, match="code -1 at codebook 0, frame 2"):
        next(stream)
    assert module.session.stream_decoder.streams == []  # the slot was freed


@cuda
def test_cuda_graphs_match_eager_and_decode(no_tf32):
    model = random_model("tiny", seed=4).cuda()
    codes = random_codes(3, 23, model.config, seed=8).cuda()
    with torch.no_grad():
        full = model.decode(codes)
    outputs = {}
    for graphs in (True, False):
        decoder = StreamingDecoder(model, max_streams=3, cuda_graphs=graphs, frames_per_forward=16)
        sids = [decoder.open() for _ in range(3)]
        sizes = [chunk_sizes(23, seed=i, largest=9) for i in range(3)]
        done, out = [0, 0, 0], [[], [], []]
        while any(sizes):
            chunks = {}
            for i, sid in enumerate(sids):
                if sizes[i]:
                    n = sizes[i].pop(0)
                    chunks[sid] = codes[i, :, done[i] : done[i] + n]
                    done[i] += n
            for sid, wav in decoder.step(chunks).items():
                out[sids.index(sid)].append(wav)
        outputs[graphs] = [torch.cat(o, dim=-1) for o in out]
        assert bool(decoder.engine.graphs and decoder.engine.graphs.graphs) == graphs
    for i in range(3):
        assert max_diff(outputs[True][i], full[i]) <= 1e-4
        assert max_diff(outputs[True][i], outputs[False][i]) <= 1e-5


@cuda
def test_cuda_bf16_streaming_is_as_faithful_as_bf16_decode():
    model = random_model("tiny", seed=5).cuda()
    codes = random_codes(1, 40, model.config, seed=9).cuda()
    with torch.no_grad():
        ref = model.decode(codes)[0].double()
        bf16 = Code2Wav(model.config).cuda().to(torch.bfloat16)
        bf16.load_state_dict(model.state_dict())
        batch = bf16.decode(codes)[0].double()
    decoder = StreamingDecoder(bf16, max_streams=1)
    sid = decoder.open()
    pieces = [decoder.step({sid: codes[0, :, s : s + n]})[sid] for s, n in ((0, 1), (1, 9), (10, 10), (20, 20))]
    streamed = torch.cat(pieces, dim=-1).double()

    def rel(x: torch.Tensor) -> float:
        return ((x - ref).norm() / ref.norm()).item()

    assert rel(streamed) <= 1.25 * rel(batch), (rel(streamed), rel(batch))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32])
def test_chunks_of_any_integer_dtype_stream_exactly(odd_model, dtype):
    """Codec codes often come as uint16: a chunk is range-checked in int64, never in its own dtype."""
    codes = random_codes(1, 9, odd_model.config, seed=31)[0] % 200  # values every dtype above holds
    decoder = StreamingDecoder(odd_model, max_streams=1)
    decoder.open("s")
    pieces = [decoder.step({"s": codes[:, a:b].to(dtype)})["s"] for a, b in ((0, 1), (1, 5), (5, 9))]
    with torch.no_grad():
        assert max_diff(torch.cat(pieces, -1), odd_model.decode(codes[None])[0]) <= 1e-5
    if dtype != torch.uint8:  # 2048 does not fit in a uint8
        bad = codes[:, :1].clone()
        bad[0, 0] = odd_model.config.codebook_size
        with pytest.raises(ValueError, match=r"stream 's': code 2048 at codebook 0, frame 9 is outside"):
            decoder.step({"s": bad.to(dtype)})


def test_a_batch_decode_on_an_engine_whose_slots_streams_hold_raises_instead_of_waiting(tiny):
    """``engine=`` shares one engine: with every slot held by an open stream, a decode has nothing to
    run and nothing will free a slot, so it says so (it used to loop for ever)."""
    engine = DecodeEngine(tiny, max_rows=2)
    decoder = StreamingDecoder(tiny, engine=engine)
    held = [decoder.open(), decoder.open()]
    with pytest.raises(ValueError, match=r"all 2 decode slots are in use \(by open streams\)"):
        engine.decode(random_codes(1, 5, tiny.config), [5])
    decoder.close(held[0])
    codes = random_codes(1, 5, tiny.config, seed=3)
    with torch.no_grad():
        assert max_diff(engine.decode(codes, [5])[0], tiny.decode(codes)[0]) <= 1e-5


def test_warmup_decodes_its_own_scratch_streams_only(tiny):
    decoder = StreamingDecoder(tiny, max_streams=4)
    codes = random_codes(1, 9, tiny.config, seed=5)[0]
    sid = decoder.open()
    decoder.step({sid: codes[:, :5]})
    first = decoder.step({sid: codes[:, 5:5]})[sid]  # nothing new
    decoder.push(sid, codes[:, 5:])  # pushed, not yet stepped: warmup must leave it queued
    decoder.warmup(chunk_sizes=(1, 3), batch_sizes=(1, 2))
    assert decoder.frames(sid) == 5 and first.shape[-1] == 0
    rest = decoder.step()[sid]
    assert rest.shape[-1] == 4 * tiny.config.total_upsample


def test_a_step_whose_forward_fails_marks_its_streams_failed_and_spares_the_others(tiny):
    """A forward that raises mid-step (not out of memory) may leave a stream's state half advanced:
    the stream refuses further use, close() frees it, and a new stream decodes exactly."""
    decoder = StreamingDecoder(tiny, max_streams=4, frames_per_forward=4)
    codes = random_codes(1, 12, tiny.config, seed=6)[0]
    a, b = decoder.open(), decoder.open()
    decoder.step({b: codes[:, :2]})
    calls = []

    def fail_on_the_second_forward(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")

    hook = tiny.register_forward_pre_hook(fail_on_the_second_forward)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            decoder.step({a: codes[:, :10]})  # 10 frames at 4 per forward: three forwards
    finally:
        hook.remove()
    with pytest.raises(ValueError, match=r"stream 0 failed in an earlier step \(RuntimeError: injected failure\)"):
        decoder.step({a: codes[:, 10:]})
    assert decoder.close(a).shape[-1] == 0 and decoder.streams == [b]
    out = torch.cat([decoder.step({b: codes[:, 2:]})[b]], dim=-1)  # b was not in the failed step
    assert out.shape[-1] == 10 * tiny.config.total_upsample
    c = decoder.open()
    whole = torch.cat([decoder.step({c: codes})[c], decoder.close(c)], dim=-1)
    with torch.no_grad():
        assert max_diff(whole, tiny.decode(codes[None])[0]) <= 1e-5


def test_an_iterator_whose_stream_was_closed_never_touches_a_new_stream_with_its_id(tiny):
    decoder = StreamingDecoder(tiny, max_streams=4)
    codes = random_codes(1, 6, tiny.config, seed=8)[0]
    old = decoder.stream([codes[:, :2], codes[:, 2:4]], stream_id="x")
    next(old)
    decoder.close("x")
    decoder.open("x")
    decoder.step({"x": codes[:, :3]})
    with pytest.raises(ValueError, match="stream 'x' was closed and its id taken by another stream"):
        next(old)
    assert decoder.streams == ["x"] and decoder.frames("x") == 3  # the new stream is untouched


def test_step_takes_a_mapping_and_says_so(tiny):
    decoder = StreamingDecoder(tiny)
    with pytest.raises(ValueError, match=r"step\(\) takes a mapping \{stream id: codes"):
        decoder.step([random_codes(1, 2, tiny.config)[0]])
    with pytest.raises(ValueError, match="frames_per_forward must be an integer >= 1"):
        StreamingDecoder(tiny, frames_per_forward=1.5)


def test_fit_retires_the_modules_streaming_decoders(tmp_path):
    """A stream's state was decoded with the weights of its first steps; fit changes them in place, so
    the module's decoders are retired when fit starts: their streams raise, saying why, and
    ``module.stream`` builds a new decoder on the tuned weights."""
    teacher = make_teacher("tiny")
    train = make_demo_data(tmp_path, 4, 1.0, 1.5, teacher=teacher, seed=0, name="train.jsonl")
    module = Code2WavModule(model=random_model("tiny", seed=3))
    decoder = module.streaming_decoder(max_streams=4)
    codes = random_codes(1, 6, module.config, seed=9)[0]
    sid = decoder.open()
    decoder.step({sid: codes[:, :3]})
    next(module.stream([codes[:, :2], codes[:, 2:]]))
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, datamodule=CodesDataModule(train=str(train), batch_size=2, crop_frames=10))
    with pytest.raises(ValueError, match="decoder was retired: its module started trainer.fit"):
        decoder.step({sid: codes[:, 3:]})
    with pytest.raises(ValueError, match="decoder was retired"):
        decoder.open()
    pieces = list(module.stream([codes[:, :2], codes[:, 2:]]))  # a new decoder, on the tuned weights
    with torch.no_grad():
        assert max_diff(torch.cat(pieces, dim=-1), module.model.decode(codes[None])[0]) <= 1e-5


def test_a_module_that_made_a_streaming_decoder_still_pickles(tiny):
    """The module keeps weak references to its decoders (to retire them at fit); a copy or pickle of
    it (torch.save of the module, a spawned process) takes none of them."""
    import pickle

    module = Code2WavModule(model=tiny)
    module.streaming_decoder(max_streams=2)
    copied = pickle.loads(pickle.dumps(module))
    assert copied.streaming_decoder(max_streams=1).max_streams == 1


def test_a_module_that_predicted_pickles_and_copies_without_its_engine(tiny):
    """predict keeps the engine and weak references to it: pickling failed after a predict (so did
    ``ddp_spawn`` of that module), and a deep copy kept the original's engine, so a setting changed on
    the copy was ignored. A copy or pickle now takes no engine and builds its own."""
    import copy
    import pickle

    module = Code2WavModule(model=tiny)
    codes = list(random_codes(3, 11, module.config, seed=2))

    def predict(m):
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        return trainer.predict(m, datamodule=CodesDataModule(predict=codes, batch_size=3))

    predict(module)
    assert module.engine is not None and module.engine.frames_per_forward != 8
    restored = pickle.loads(pickle.dumps(module))
    assert restored.engine is None
    twin = copy.deepcopy(module)
    twin.frames_per_forward = 8
    out = predict(twin)
    assert twin.engine is not module.engine and twin.engine.frames_per_forward == 8
    with torch.no_grad():
        for request, audio in zip(codes, out[0].pooler_output):
            assert max_diff(audio["model_outputs"], module.model.decode(request[None])[0]) <= 1e-5
