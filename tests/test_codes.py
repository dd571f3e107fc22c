"""Codes a model and a job take: any integer dtype, range checks that never wrap, a check that
follows in-place writes, and a bad request that fails alone while the others decode."""

import numpy as np
import pytest
import torch
from conftest import random_codes
from helpers import TINY, assert_wav, predict_to, rows, trainer_kwargs
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from omni_lightning import Code2WavModule, CodesDataset, Trainer, WaveformWriter
from omni_lightning.models import validate_codes


def test_every_integer_dtype_decodes_and_a_float_or_bool_file_is_a_recorded_failure(tmp_path, model):
    src = tmp_path / "codes"
    src.mkdir()
    small = random_codes(1, 6, seed=1)[0].numpy() % 128  # valid codes that fit int8
    wide = random_codes(1, 7, seed=2)[0].numpy()  # up to 2047
    expected = {}
    for dtype in ("uint8", "int8"):
        np.save(src / f"{dtype}.npy", small.astype(dtype))
        expected[dtype] = small
    for dtype in ("uint16", "int16", "uint32", "int32", "int64", "uint64", ">i4"):
        name = "big_endian_int32" if dtype == ">i4" else dtype
        np.save(src / f"{name}.npy", wide.astype(dtype))
        expected[name] = wide
    torch.save(torch.from_numpy(wide.astype(np.uint16)), src / "torch_uint16.pt")
    save_file({"codes": torch.from_numpy(wide.astype(np.int16))}, str(src / "st_int16.safetensors"))
    expected.update(torch_uint16=wide, st_int16=wide)
    np.save(src / "float.npy", wide.astype(np.float32))
    torch.save(torch.from_numpy(wide > 5), src / "flags.pt")

    writer = predict_to(tmp_path / "out", src, model, batch_size=4)
    got = rows(tmp_path / "out")
    assert sorted(got) == sorted([*expected, "float", "flags"])
    for name, codes in expected.items():
        assert got[name]["status"] == "ok", got[name]
        assert_wav(tmp_path / "out", got[name], codes, model)
    assert got["float"]["status"] == "error" and "dtype float32" in got["float"]["reason"]
    assert got["flags"]["status"] == "error" and "dtype bool" in got["flags"]["reason"]
    assert writer.stats["ok"] == len(expected) and writer.stats["error"] == 2 and not writer.all_written


def test_range_checks_compare_safely_in_every_integer_dtype():
    codes = random_codes(1, 5)[0] % 200
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32):
        validate_codes((codes % 100).to(dtype)[None], TINY)  # valid codes: no wrap-around "out of range"
    wide = codes.clone()
    wide[3, 2] = 4000
    with pytest.raises(ValueError, match=r"code 4000 at codebook 3, frame 2"):
        validate_codes(wide.to(torch.uint16)[None], TINY)
    with pytest.raises(ValueError, match=r"request 'u': code 70000 at codebook 0, frame 0 is outside"):
        CodesDataset({"u": torch.full((16, 3), 70000, dtype=torch.uint64)}, TINY)


def test_a_tensor_in_memory_written_after_its_check_is_checked_again_when_loaded():
    """In memory, a request whose values passed at the build is not read again when loaded, unless
    it was written in place since (its version counter moved): then the write is caught there."""
    good, bad = random_codes(1, 6, seed=1)[0].to(torch.int16), random_codes(1, 6, seed=2)[0]
    ds = CodesDataset({"good": good, "bad": bad}, TINY, on_bad_input="skip")
    assert ds.bad == {} and [e.checked_version for e in ds.entries] == [good._version, bad._version]
    bad[2, 3] = 5000  # in place, after the build
    items = {item["id"]: item for item in (ds[0], ds[1])}
    assert torch.equal(items["good"]["codes"], good.long()) and items["good"]["codes"].dtype == torch.long
    assert "code 5000 at codebook 2, frame 3" in items["bad"]["error"]
    assert torch.equal(ds[0]["codes"], good.long())  # loaded again, the same
    with torch.inference_mode():  # a talker's codes made under inference mode: no version counter
        made = {"ok": random_codes(1, 5, seed=3)[0], "bad": random_codes(1, 5, seed=4)[0]}
        made["bad"][1, 1] = 7000
    ds = CodesDataset(made, TINY, on_bad_input="skip")
    assert [e.checked_version for e in ds.entries] == [None, None] and "code 7000" in ds.bad["bad"]
    with torch.inference_mode():
        made["ok"][0, 0] = 9000  # written after the build: caught when loaded, as every time
    assert "code 9000 at codebook 0, frame 0" in ds[0]["error"]


def test_a_bad_request_in_a_users_own_batch_fails_alone_in_predict_and_the_others_are_decoded(tmp_path, model):
    """A user's DataLoader (or codes written through a NumPy view after the dataset checked them: no
    version counter moves) can bring a bad request to the module's own check: in predict it fails
    alone, recorded with its reason, as a bad request the data finds does. A batch problem is raised."""
    good, bad = random_codes(1, 7, seed=1)[0], random_codes(1, 5, seed=2)[0]
    bad[3, 2] = 5000
    codes = torch.zeros(3, 16, 7, dtype=torch.long)
    codes[0], codes[1, :, :5], codes[2] = good, bad, good
    batch = {"codes": codes, "lengths": torch.tensor([7, 5, 7]), "req_ids": ["g1", "b", "g2"]}
    writer = WaveformWriter(tmp_path / "out")
    loader = DataLoader([batch], batch_size=None)  # the batches as they are
    preds = Trainer(**trainer_kwargs(callbacks=[writer])).predict(Code2WavModule(model=model), loader)
    (out,) = preds
    assert out.req_ids == ["g1", "g2"] and list(out.errors) == ["b"]
    assert out.errors["b"].startswith("request 'b': code 5000 at codebook 3, frame 2 is outside [0, 2048)")
    with torch.inference_mode():
        want = model(good[None])[0]
    assert all(torch.allclose(p["model_outputs"], want, atol=1e-5) for p in out.pooler_output)
    got = rows(tmp_path / "out")
    assert got["b"]["status"] == "error" and got["g1"]["status"] == got["g2"]["status"] == "ok"
    with pytest.raises(ValueError, match="has 8 codebooks"):  # the batch's own problem: not one request's
        broken = DataLoader([{**batch, "codes": codes[:, :8]}], batch_size=None)
        Trainer(**trainer_kwargs()).predict(Code2WavModule(model=model), broken)


@pytest.mark.parametrize(
    "codes, match",
    [
        (random_codes(1, 5).float(), "codes have dtype float32; codes must be integers"),
        (random_codes(1, 5).bool(), "codes have dtype bool; codes must be integers"),
        (random_codes(1, 5)[0], r"shape \[batch, codebooks, frames\]"),
        (random_codes(1, 5)[:, :8], "8 codebooks, this model expects 16"),
        (random_codes(1, 5)[..., :0], "empty"),
        (torch.zeros(0, 16, 5, dtype=torch.long), "batch size 0"),
        (random_codes(1, 5) + 2048, "outside \\[0, 2048\\)"),
        (random_codes(1, 5) - 2048, "outside \\[0, 2048\\)"),
    ],
)
def test_forward_rejects_bad_codes_with_a_clear_value_error(tiny_model, codes, match):
    with pytest.raises(ValueError, match=match):
        tiny_model(codes)


def test_forward_and_decode_take_any_integer_dtype(tiny_model):
    codes = random_codes(2, 5) % 200
    with torch.inference_mode():
        want = tiny_model(codes)
        for dtype in (torch.uint8, torch.int16, torch.uint16, torch.int32):
            assert torch.equal(tiny_model(codes.to(dtype)), want)
            assert torch.equal(tiny_model.decode(codes.to(dtype), [5, 3])[1], want[1, :, : tiny_model.output_length(3)])


def test_one_request_given_to_a_batch_check_is_told_how_to_make_it_a_batch():
    with pytest.raises(ValueError, match=r"got \(16, 5\) \(one request\? codes\[None\] is a batch of it\)"):
        validate_codes(random_codes(1, 5)[0], TINY)
