"""A request body as codes: JSON ``{"codes": [[...], ...]}``, or the bytes of a ``.npy`` or ``.safetensors``
code file (``data/io.py`` reads them, as predict reads files), checked by ``models/codes.py``'s validator.

Every problem is a :class:`BadRequest` with an HTTP status and one line naming the bad value: 400 for a
body that is not what it says it is (a corrupt ``.npy`` said in our words, never numpy's advice to load
pickles), 415 for a content type that is none of JSON (``application/json``, ``text/json``,
``application/*+json``), ``.npy``, ``.safetensors`` or ``application/octet-stream`` (told apart by the
bytes), a missing one included; 422 for codes a decode refuses.
Not done: ``.pt`` bodies (a pickle: reading one from a client runs its code) and gzip-encoded bodies.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from omni_lightning.data.io import load_codes_bytes, numpy_to_tensor
from omni_lightning.models.codes import check_request_codes
from omni_lightning.models.config import Code2WavConfig

NPY_MAGIC, JSON_TYPES = b"\x93NUMPY", ("application/json", "text/json")
BINARY_TYPES = {
    "application/x-npy": ".npy",
    "application/npy": ".npy",
    "application/x-safetensors": ".safetensors",
    "application/safetensors": ".safetensors",
    "application/octet-stream": None,  # told apart by the bytes: .npy's magic, else safetensors
}


class BadRequest(ValueError):
    """A client's mistake: ``status`` (4xx) and one line saying what is wrong (the ValueError's message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the reader said
        self.status = status


def body_codes(
    body: bytes, content_type: str | None, config: Code2WavConfig, who: str, chunk_from: int | None = None
) -> torch.Tensor:
    """The codes ``[Q, n]`` (int64) of a body, checked as ``decode`` checks a request (``chunk_from``: a
    stream's chunk starting at that frame, as ``StreamingDecoder`` checks it); :class:`BadRequest` otherwise."""
    if not body:
        raise BadRequest(400, f'{who}: the body is empty: send {{"codes": [[...16 rows...]]}} or a .npy file')
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind in JSON_TYPES or (kind.startswith("application/") and kind.endswith("+json")):
        raw = json_codes(body, who)
    elif kind in BINARY_TYPES:
        suffix = BINARY_TYPES[kind] or (".npy" if body.startswith(NPY_MAGIC) else ".safetensors")
        try:
            if suffix == ".npy":
                check_npy(body, f"{who}: the body")
            raw = load_codes_bytes(body, suffix, f"{who}: the body")
        except ValueError as err:
            raise BadRequest(400, str(err)) from err
    else:
        given = f"content type {kind!r} is not taken" if kind else "no Content-Type was given"
        raise BadRequest(415, f"{who}: {given}: use application/json, application/x-npy or application/x-safetensors")
    try:
        return check_request_codes(raw, config, who, chunk_from=chunk_from)
    except ValueError as err:
        raise BadRequest(422, str(err)) from err


def check_npy(body: bytes, where: str) -> None:
    """ValueError in our words for a ``.npy`` file numpy would refuse: no magic, a corrupt header, Python
    objects (a pickle, never loaded) or fewer data bytes than its header says. Others go to numpy."""
    import numpy as np
    from numpy.lib import format as npy

    f = io.BytesIO(body)
    try:
        version = npy.read_magic(f)
    except ValueError:
        raise ValueError(f"{where} is not a .npy file (it does not start with numpy's magic and version)") from None
    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    if version not in readers:
        if version == (3, 0):  # (a UTF-8 header: numpy reads it)
            return
        raise ValueError(f"{where} is not a .npy file (its format version {version} is none numpy writes)")
    try:
        shape, _, dtype = readers[version](f)
    except (ValueError, SyntaxError, TypeError):
        raise ValueError(f"{where} has a corrupt .npy header: save the codes with numpy.save") from None
    if dtype.hasobject:
        raise ValueError(f"{where} holds Python objects (dtype {dtype}), which are never unpickled: send integer codes")
    expected, present = int(np.prod(shape)) * dtype.itemsize, len(body) - f.tell()
    if present < expected:
        raise ValueError(
            f"{where} is cut short: its header says {list(shape)} {dtype} ({expected} bytes), {present} bytes follow"
        )


def json_codes(body: bytes, who: str) -> torch.Tensor:
    """``{"codes": [[...], ...]}`` as a tensor of the values' own type (floats stay floats: the check names them)."""
    import numpy as np

    try:
        value: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(400, f"{who}: the body is not valid JSON ({err})") from err
    if not isinstance(value, dict) or "codes" not in value:
        got = f"keys {sorted(value)[:8]}" if isinstance(value, dict) else f"a JSON {type(value).__name__}"
        raise BadRequest(400, f'{who}: the body must be an object {{"codes": [[...], ...]}}, got {got}')
    codes = value["codes"]
    if not isinstance(codes, list) or not all(isinstance(row, list) for row in codes):
        raise BadRequest(
            400, f'{who}: "codes" must be a list of rows (one list of integers per codebook), got {_shown(codes)}'
        )
    try:
        array = np.asarray(codes)
    except (ValueError, OverflowError, TypeError) as err:
        lengths = sorted({len(row) for row in codes})
        why = f"rows of different lengths {lengths[:6]}" if len(lengths) > 1 else str(err)
        raise BadRequest(400, f'{who}: "codes" is not a [codebooks, frames] array of integers: {why}') from err
    if array.dtype == object:
        raise BadRequest(400, f'{who}: "codes" holds values too large for int64 or of mixed types')
    if array.size == 0:  # [] and [[], ...] are float arrays to numpy: no value, so no dtype to blame
        array = array.astype(np.int64).reshape(array.shape if array.ndim > 1 else (0, 0))
    try:
        return numpy_to_tensor(array, f'{who}: "codes"')
    except ValueError as err:
        raise BadRequest(422, str(err)) from err


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
