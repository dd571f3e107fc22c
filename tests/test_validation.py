"""Bad codes fail with a ValueError that says what and where, before any embedding lookup."""

import pytest
import torch
from conftest import random_codes

from omni_lightning import Code2WavConfig, validate_codes

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
        (random_codes(1, 5).float(), "integer tensor, got dtype torch.float32"),
        (random_codes(1, 5).bool(), "integer tensor"),
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
    codes = torch.zeros(1, 16, 3, dtype=torch.uint64)
    codes[0, 2, 1] = 2**63 + 5
    bad(codes, match=r"request 0: code 9223372036854775813 at codebook 2, frame 1 is outside")
