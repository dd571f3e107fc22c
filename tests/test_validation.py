"""Bad codes fail with a ValueError that says what and where, before any embedding lookup; a bad
argument of a public constructor or method fails naming the argument and the value."""

import numpy as np
import pytest
import torch
from conftest import random_codes

from omni_lightning import (
    Code2WavConfig,
    Code2WavModule,
    CodesDataModule,
    CodesDataset,
    DecodeEngine,
    StreamingDecoder,
    WaveformWriter,
    validate_codes,
)
from omni_lightning.errors import UsageError, check_count

CONFIG = Code2WavConfig.from_name("tiny")


def bad(codes, lengths=None, req_ids=None, match=""):
    with pytest.raises(ValueError, match=match):
        validate_codes(codes, CONFIG, lengths, req_ids)


def test_out_of_range_codes_name_request_codebook_and_frame():
    codes = random_codes(3, 10)
    codes[1, 4, 7] = 2048
    bad(
        codes,
        req_ids=["a", "b", "c"],
        match=r"request 'b': code 2048 at codebook 4, frame 7 is outside \[0, 2048\)",
    )
    codes[1, 4, 7] = -3
    codes[2, 0, 0] = 9999
    bad(codes, match=r"request 1: code -3 at codebook 4, frame 7 .*\(2 bad values in the batch\)")
    one = random_codes(1, 4)
    one[0, :2, :] = -1
    bad(one, req_ids=["x"], match=r"request 'x': code -1 .*\(8 bad values in the request\)$")


def test_pad_region_is_not_checked_but_the_request_is():
    codes = random_codes(2, 10)
    codes[0, :, 6:] = -1
    assert validate_codes(codes, CONFIG, [6, 10]).tolist() == [6, 10]
    bad(codes, [7, 10], match=r"request 0: code -1 at codebook 0, frame 6")


@pytest.mark.parametrize(
    "codes, match",
    [
        (random_codes(1, 5).float(), r"codes have dtype float32; codes must be integers \(int8 ... int64"),
        (random_codes(1, 5).bool(), "codes have dtype bool"),
        (random_codes(1, 5)[0], r"shape \[batch, codebooks, frames\]"),
        (random_codes(1, 5)[:, :8], r"request 0: shape \(8, 5\) has 8 codebooks, this model expects 16$"),
        (random_codes(1, 40).transpose(1, 2), r"shape \(40, 16\) .* expects 16 \(frames first\?"),
        (random_codes(1, 5)[..., :0], "empty"),
        (torch.zeros(0, 16, 5, dtype=torch.long), "batch size 0"),
        ([[1, 2]], "torch.Tensor"),
    ],
)
def test_malformed_batches(codes, match):
    bad(codes, match=match)


@pytest.mark.parametrize(
    "lengths, match",
    [
        ([0, 5], r"request 'x' is empty \(length 0\)"),
        ([3, 6], "request 'y' has length 6, longer than the 5 padded frames"),
        ([3], r"shape \[2\]"),
        ([3.0, 4.0], "integers"),
    ],
)
def test_bad_lengths(lengths, match):
    bad(random_codes(2, 5), torch.tensor(lengths), req_ids=["x", "y"], match=match)


@pytest.mark.parametrize(
    "lengths, match",
    [([3], r"shape \[2\]"), ([20, 3], "request 0 has length 20, longer than the 10"), ([0, 3], r"is empty \(length 0")],
)
def test_lengths_are_checked_on_every_decode_path_never_a_short_waveform(tiny_model, lengths, match):
    """The engine (a public export) and ``decode(validate=False)`` check lengths as ``validate_codes``
    does: a wrong count or a length past the batch would otherwise give a short or missing waveform."""
    codes = random_codes(2, 10)
    with pytest.raises(ValueError, match=match):
        DecodeEngine(tiny_model).decode(codes, lengths)
    with pytest.raises(ValueError, match=match):
        tiny_model.decode(codes, lengths, validate=False)
    assert [w.shape[-1] for w in DecodeEngine(tiny_model).decode(codes, [10, 3])] == [
        tiny_model.output_length(10), tiny_model.output_length(3)]  # fmt: skip


def test_decode_validates_before_lookup(tiny_model):
    codes = random_codes(1, 4)
    codes[0, 15, 3] = 99999
    with pytest.raises(ValueError, match="codebook 15, frame 3"):
        tiny_model.decode(codes)
    with pytest.raises(ValueError, match="codebook 15, frame 3"):
        tiny_model.chunked_decode(codes, chunk_size=2)


@pytest.mark.parametrize("ids", [["a"], ["a", "b", "c"]])
def test_request_ids_must_match_the_batch(ids):
    """Two requests with one or three ids: outputs would be attached to the wrong requests."""
    bad(random_codes(2, 5), req_ids=ids, match=rf"{len(ids)} request ids for a batch of 2 requests")


def test_a_uint64_code_past_int64_is_reported_as_given():
    values = np.zeros((1, 16, 3), dtype=np.uint64)
    values[0, 2, 1] = 2**63 + 5  # (torch 2.11 cannot set a uint64 element past int64 from a Python int)
    codes = torch.from_numpy(values)
    bad(codes, match=r"request 0: code 9223372036854775813 at codebook 2, frame 1 is outside")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: Code2WavModule(model=m, freeze="decoder."), r"freeze is a list .* got the string 'decoder.'"),
        (lambda m: Code2WavModule(model=m, train_only="decoder."), r"train_only is a list"),
        (lambda m: Code2WavModule(model="tiny"), r"model must be a Code2Wav .* got str 'tiny'; pass config='tiny'"),
        (lambda m: Code2WavModule(model=m, frames_per_forward=0.5), r"frames_per_forward must be an integer >= 1"),
        (lambda m: Code2WavConfig.from_name("tiny", num_attention_heads=0), "num_attention_heads must be >= 1, got 0"),
        (lambda m: StreamingDecoder(m, max_streams=2.5), "max_streams must be an integer >= 1, got 2.5"),
        (lambda m: m.chunked_decode(random_codes(1, 5), chunk_size=None), "chunk_size must be an integer >= 1, got No"),
        (lambda m: CodesDataModule(predict="x", batch_size="8"), "batch_size must be an integer >= 1, got '8'"),
        (lambda m: CodesDataModule(predict="x", num_workers=-1), r"num_workers must be an integer >= 0 \(or None\)"),
        (lambda m: CodesDataset(5, "tiny"), "a data source is a folder, a JSONL manifest, or a list .* got int 5"),
        (lambda m: WaveformWriter("out", encoders=-1), r"encoders must be an integer >= 1 \(or None\), got -1"),
        (lambda m: WaveformWriter("out", max_pending=0), "max_pending must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_name_themselves_and_their_value(tiny_model, make, match):
    with pytest.raises(ValueError, match=match):  # UsageError, or the config's own ValueError listing its problems
        make(tiny_model)


def test_counts_take_any_integer_type_but_not_a_bool():
    check_count("batch_size", np.int64(8))
    with pytest.raises(UsageError, match="batch_size must be an integer >= 1, got True"):
        check_count("batch_size", True)
