"""A user's mistakes on the public decode APIs: each a one-line ValueError naming the bad value, no slot lost."""

import gc

import pytest
import torch
from conftest import micro_config, random_codes, random_model

from omni_lightning import Code2WavModule, DecodeEngine, StreamingDecoder


@pytest.fixture(scope="module")
def micro():
    return random_model(micro_config(), seed=3)


def test_engine_decode_names_the_bad_request_and_its_frame_in_the_batch(micro):
    """Checked per forward, a bad code was named by its row and frame in that forward (request 0, frame 7)."""
    codes = random_codes(3, 20, micro.config, seed=1)
    codes[2, 5, 15] = 3000
    engine = DecodeEngine(micro, max_rows=2, frames_per_forward=8)
    with pytest.raises(ValueError, match=r"^request 2: code 3000 at codebook 5, frame 15 is outside"):
        engine.decode(codes, [20, 5, 18])
    assert engine.work["forwards"] == 0 and len(engine._free) == 2  # refused before any forward


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda c: c.float(), "codes have dtype float32; codes must be integers"),  # was decoded, truncated
        (lambda c: c[0], r"got \(16, 20\) \(one request\? codes\[None\] is a batch of it\)"),
        (lambda c: c.tolist(), "codes must be a torch.Tensor"),
    ],
)
def test_engine_decode_refuses_what_decode_refuses(micro, bad, match):
    codes = random_codes(3, 20, micro.config, seed=1)
    engine = DecodeEngine(micro, max_rows=2)
    with pytest.raises(ValueError, match=match):
        engine.decode(bad(codes), [5, 5, 5])
    with torch.no_grad():  # lengths None: every request all T frames, as Code2Wav.decode
        wavs = engine.decode(codes[:2, :, :3])
        assert [w.shape[-1] for w in wavs] == [micro.output_length(3)] * 2
        assert engine.decode(codes[:0], []) == []  # a batch whose requests all failed their checks


def test_decode_without_validation_still_checks_dtype_and_shape(micro):
    """``validate=False`` skips the range check only: float codes were cast (truncated) and decoded."""
    codes = random_codes(2, 6, micro.config, seed=1)
    for decode in (micro.decode, micro.chunked_decode):
        with pytest.raises(ValueError, match="codes have dtype float32"):
            decode(codes.float() + 0.5, validate=False)
        with pytest.raises(ValueError, match=r"request 0 is empty \(0 frames\)"):
            decode(codes[..., :0], validate=False)


def test_a_stream_of_one_bare_chunk_is_refused_holding_no_slot(micro):
    decoder = StreamingDecoder(micro, max_streams=1)
    codes = random_codes(1, 4, micro.config)[0]
    with pytest.raises(ValueError, match=r"got one tensor \(16, 4\): pass \[codes\]"):
        next(decoder.stream(codes))  # iterated, its rows were taken for chunks
    assert decoder.streams == [] and len(decoder.engine._free) == 1


def test_warmup_refuses_bad_sizes_naming_them(micro):
    decoder = StreamingDecoder(micro, max_streams=1)
    for sizes, match in [((-1,), r"got \(-1,\)"), ((2.5,), r"got \(2.5,\)"), (3, "got 3")]:
        with pytest.raises(ValueError, match=f"chunk_sizes must be .*{match}"):
            decoder.warmup(chunk_sizes=sizes)
    assert decoder.streams == [] and len(decoder.engine._free) == 1


def test_closing_a_stream_twice_says_so(micro):
    decoder = StreamingDecoder(micro, max_streams=1)
    decoder.close(decoder.open("a"))
    with pytest.raises(ValueError, match="^stream 'a' is closed already: close"):
        decoder.close("a")
    with pytest.raises(ValueError, match="^stream 'a' is closed already: a chunk after close"):
        decoder.push("a", random_codes(1, 2, micro.config)[0])


def test_an_abandoned_module_stream_frees_its_slot_and_the_next_is_exact():
    module = Code2WavModule(config=micro_config(), random_weights=True)
    codes = random_codes(1, 9, module.config, seed=4)[0]
    with torch.no_grad():
        for _ in range(9):  # more than the 8 slots module.stream keeps: each abandoned one came back
            pieces = module.stream([codes[:, :2], codes[:, 2:]])
            next(pieces)
            del pieces
            gc.collect()
        got = torch.cat(list(module.stream([codes[:, :0], codes[:, :1], codes[:, 1:]])), dim=-1)
        want = module.model(codes[None])[0]
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_chunk_given_as_a_batch_of_one_is_told_how_to_pass_it():
    decoder = StreamingDecoder(random_model(micro_config(), seed=1), max_streams=1, cuda_graphs=False)
    stream = decoder.open()
    with pytest.raises(ValueError, match=r"got \(1, 16, 5\) \(a batch of one\? pass codes\[0\]\)"):
        decoder.push(stream, torch.randint(0, 2048, (1, 16, 5)))
