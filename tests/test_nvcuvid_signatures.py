"""The ctypes signatures of the nvcuvid backend's C surface, checked without a GPU: a wrong argtype
is a crash (or a truncated pointer) on the GPU that the CPU tests would not see otherwise.

- nvcuvid_native.SIGNATURES holds exactly the C functions the module calls, each as SOURCE
  defines it, and declare() / library() set them on the library.
- The driver functions handed to the C code as pointers (State.decode ... sync, the feeder's parse
  and setctx) have in nvcuvid_api's tables the shape the C code calls them with.
- nvcuvid_api's tables hold exactly the driver functions the nvcuvid backend calls.
"""

from __future__ import annotations

import ctypes
import inspect
import re
import shutil
from ctypes import c_int, c_longlong, c_uint, c_ulonglong, c_void_p
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcodec.video import nvcuvid_api as api
from kvcodec.video import nvcuvid_native as native

VIDEO = Path(native.__file__).parent
CALLBACKS = {"kv_sequence", "kv_decode", "kv_display"}  # handed to the parser by address, never called from Python
SCALARS = {"int": c_int, "long long": c_longlong, "unsigned int": c_uint, "unsigned long long": c_ulonglong}


def _python_text(path: Path) -> str:
    """A module's Python text, without nvcuvid_native's C SOURCE."""
    text = path.read_text()
    return text.replace(native.SOURCE, "") if path.name == "nvcuvid_native.py" else text


def _c_type(decl: str):  # noqa: ANN202 - a ctypes type, "pointer" or None (void)
    """The ctypes type a C parameter or return type is passed as: any pointer is c_void_p."""
    if "*" in decl:
        return c_void_p
    words = [w for w in decl.split() if w != "const"]
    return None if words == ["void"] else SCALARS[" ".join(words)]


def _param_type(param: str):  # noqa: ANN202
    """The ctypes type of a named C parameter ("long long timeout_us", "feeder_t *f")."""
    return c_void_p if "*" in param else _c_type(param.rsplit(maxsplit=1)[0])


def c_definitions() -> dict[str, tuple]:
    """name -> (restype, argtypes) of every function SOURCE exports (not static)."""
    found = {}
    pattern = r"^(?!static\b)([A-Za-z_][\w ]*?)\s*(\*?)\s*\b(kv_\w+)\(([^)]*)\)\s*\{"
    for ret, star, name, params in re.findall(pattern, native.SOURCE, flags=re.M):
        found[name] = (_c_type(ret + star), [_param_type(p) for p in params.split(",")])
    return found


def c_typedefs() -> dict[str, tuple]:
    """name -> (restype, argtypes) of SOURCE's function pointer typedefs (how the C code calls the driver)."""
    found = {}
    for ret, name, params in re.findall(r"typedef (\w[\w ]*?) \(\*(\w+)\)\(([^)]*)\);", native.SOURCE):
        found[name] = (_c_type(ret), [_c_type(p) for p in params.split(",")])
    return found


def test_the_c_parsers_read_what_they_should():
    assert _param_type("const unsigned char *p") is c_void_p
    assert _param_type("long long timeout_us") is c_longlong
    assert _param_type("unsigned long long ptr") is c_ulonglong
    assert _c_type("void") is None
    assert c_definitions()["kv_feeder_start"][0] is c_void_p  # "void *kv_feeder_start(": a pointer


def test_the_table_holds_exactly_the_functions_the_module_calls():
    called = set(re.findall(r"\blib\.(kv_\w+)", _python_text(VIDEO / "nvcuvid_native.py")))
    assert called == set(native.SIGNATURES)


def test_every_native_function_used_anywhere_is_declared_or_a_callback():
    used = set()
    for path in VIDEO.glob("*.py"):
        used |= set(re.findall(r"\blib\.(kv_\w+)", _python_text(path)))
    assert used == set(native.SIGNATURES) | CALLBACKS
    assert set(c_definitions()) == set(native.SIGNATURES) | CALLBACKS  # nothing exported undeclared


@pytest.mark.parametrize("name", sorted(native.SIGNATURES))
def test_each_signature_is_the_c_definitions(name):
    restype, argtypes = native.SIGNATURES[name]
    assert (restype, argtypes) == c_definitions()[name]


def test_the_callbacks_have_the_parsers_callback_shape():
    defs = c_definitions()
    for name, proto in (("kv_decode", api.DecodeCallback), ("kv_display", api.DisplayCallback)):
        restype, argtypes = defs[name]
        assert restype is proto._restype_
        assert len(argtypes) == len(proto._argtypes_) and all(t is c_void_p for t in argtypes)


def _shape(t) -> object:
    """A ctypes argument type as the C side sees it: any pointer alike, a scalar as it is."""
    if t is c_void_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer)):
        return "pointer"
    return t


# SOURCE's function pointer typedef -> (the driver function in nvcuvid_api's tables, how nvcuvid.py
# hands it to the C code: a field of native.State, or an argument of native.Feeder)
HANDED_IN = {
    "decode_fn": ("cuvidDecodePicture", "decode=native.function_pointer(nv.cuvidDecodePicture)"),
    "map_fn": ("cuvidMapVideoFrame64", "map=native.function_pointer(nv.cuvidMapVideoFrame64)"),
    "unmap_fn": ("cuvidUnmapVideoFrame64", "unmap=native.function_pointer(nv.cuvidUnmapVideoFrame64)"),
    "copy_fn": ("cuMemcpy2DAsync_v2", "copy=native.function_pointer(cu.cuMemcpy2DAsync)"),
    "sync_fn": ("cuStreamSynchronize", "sync=native.function_pointer(cu.cuStreamSynchronize)"),
    "parse_fn": ("cuvidParseVideoData", "native.function_pointer(nv.cuvidParseVideoData),"),
    "setctx_fn": ("cuCtxSetCurrent", "native.function_pointer(cu.cuCtxSetCurrent),"),
}


@pytest.mark.parametrize("typedef", sorted(HANDED_IN))
def test_driver_functions_handed_to_c_match_how_c_calls_them(typedef):
    restype, argtypes = c_typedefs()[typedef]
    driver_fn, handed = HANDED_IN[typedef]
    table = api._SIGNATURES | api._CUDA_SIGNATURES
    assert restype is c_int  # a CUresult, as api._Lib declares every driver function
    assert [_shape(t) for t in argtypes] == [_shape(t) for t in table[driver_fn]]
    assert handed in (VIDEO / "nvcuvid.py").read_text()


def test_the_python_sequence_callback_has_the_shape_kv_sequence_calls():
    restype, argtypes = c_typedefs()["sequence_fn"]
    assert restype is api.SequenceCallback._restype_
    assert [_shape(t) for t in argtypes] == [_shape(t) for t in api.SequenceCallback._argtypes_]
    assert "state.sequence = native.function_pointer(self.python_sequence)" in (VIDEO / "nvcuvid.py").read_text()


def test_every_function_pointer_type_of_the_c_code_is_checked():
    assert set(c_typedefs()) == set(HANDED_IN) | {"sequence_fn"}


def test_the_driver_tables_hold_exactly_the_functions_the_backend_uses():
    used = set()
    for name in ("nvcuvid.py", "nvcuvid_api.py"):
        used |= set(re.findall(r"\.((?:cuvid|cu)[A-Z]\w*)", (VIDEO / name).read_text()))
    declared = {fn.removesuffix("_v2") for fn in api._SIGNATURES | api._CUDA_SIGNATURES}
    assert used == declared


def _stand_in(names) -> SimpleNamespace:
    return SimpleNamespace(**{name: SimpleNamespace() for name in names})


def test_declare_sets_each_signature_as_the_table_says():
    lib = _stand_in(native.SIGNATURES)
    assert native.declare(lib, native.SIGNATURES) is lib
    for name, (restype, argtypes) in native.SIGNATURES.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and fn.argtypes == argtypes


def test_declare_fails_on_a_missing_function():
    with pytest.raises(AttributeError):
        native.declare(_stand_in(list(native.SIGNATURES)[1:]), native.SIGNATURES)


def test_library_declares_the_table_on_what_it_loads(monkeypatch, tmp_path):
    lib = _stand_in(native.SIGNATURES)
    monkeypatch.setattr(native, "build", lambda directory=None: tmp_path / "stand-in.so")
    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: lib)
    native.library.cache_clear()
    try:
        assert native.library() is lib
    finally:
        native.library.cache_clear()  # the real library again for the other tests
    assert all(getattr(lib, n).argtypes == a for n, (_, a) in native.SIGNATURES.items())


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_built_library_takes_every_signature(tmp_path):
    lib = native.declare(ctypes.CDLL(str(native.build(tmp_path))), native.SIGNATURES)
    for name, (restype, argtypes) in native.SIGNATURES.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == argtypes


def test_declare_is_the_only_place_setting_native_signatures():
    """The native modules set their functions' signatures through kvcodec.native.declare alone."""
    for path in (VIDEO / "nvcuvid_native.py", VIDEO.parent / "codecs" / "zstd_native.py"):
        assert re.findall(r"\.(argtypes|restype)\b", _python_text(path)) == []
    assert re.findall(r"\.(argtypes|restype)\b", _python_text(VIDEO.parent / "native.py")) == ["restype", "argtypes"]
    assert "fn.restype, fn.argtypes = restype, argtypes" in inspect.getsource(native.declare)
