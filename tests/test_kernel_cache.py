"""The C++ kernels' build cache (accel/quant_cpp.py `KernelCache`) and the build lock (files.held_lock),
with tiny C extensions built by the C compiler in ~0.3 s each instead of the real 30-60 s build: a
good one (`version` 1), a foreign one whose constructor writes a marker file when it is opened.
The real build goes through the same class: tests/test_quant_cpp.py::test_the_real_build_is_recorded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from recurrent_depth.accel import quant_cpp
from recurrent_depth.accel.quant_cpp import KernelCache, import_extension
from recurrent_depth.files import file_sha256, held_lock

NAME = "rdepth_fake_kernel"
SOURCE = r"""
#include <Python.h>
#include <stdio.h>
#ifdef MARK
__attribute__((constructor)) static void mark(void) {
  FILE* f = fopen(MARK, "w");
  if (f) { fputs("ran", f); fclose(f); }
}
#endif
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_NAME(void) {
  PyObject* m = PyModule_Create(&def);
  if (m) PyModule_AddIntConstant(m, "version", 1);
  return m;
}
""".replace("NAME", NAME)


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, Path]:
    """{"good": a loadable extension, "evil": one whose constructor writes `marker`, "marker": that path}."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    root = tmp_path_factory.mktemp("libs")
    (root / "ext.c").write_text(SOURCE)
    marker = root / "constructor-ran"
    out = {"marker": marker}
    for kind, defines in (("good", []), ("evil", [f'-DMARK="{marker}"'])):
        out[kind] = root / f"{kind}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O0", f"-I{sysconfig.get_paths()['include']}", *defines,
                        str(root / "ext.c"), "-o", str(out[kind])], check=True, capture_output=True)
    return out


class FakeCompile:
    """A `compile` for KernelCache that copies the good library into the scratch directory and imports it."""

    def __init__(self, good: Path) -> None:
        self.good, self.calls = good, 0

    def __call__(self, name: str, scratch: Path) -> tuple[object, Path]:
        self.calls += 1
        built = scratch / f"{name}.so"
        shutil.copyfile(self.good, built)
        return import_extension(name, built), built


def refuse_to_compile(name: str, scratch: Path):
    raise AssertionError("rebuilt a kernel whose cached build checks out")


def built_cache(tmp_path: Path, libraries) -> tuple[KernelCache, FakeCompile]:
    compile = FakeCompile(libraries["good"])
    cache = KernelCache(tmp_path / "cache" / NAME, NAME, compile)
    assert cache.load().version == 1 and compile.calls == 1
    return cache, compile


def test_a_build_is_recorded_and_then_loaded_without_building(tmp_path, libraries, caplog):
    with caplog.at_level(logging.WARNING, logger=quant_cpp.__name__):
        cache, _ = built_cache(tmp_path, libraries)
    assert "building the C++ quantized-KV kernels in" in caplog.text
    assert re.search(r"built the C\+\+ quantized-KV kernels in \d+\.\d s", caplog.text)
    record = json.loads(cache.record.read_text())
    assert record["sha256"] == file_sha256(cache.library) == file_sha256(libraries["good"])
    assert record["uid"] == os.getuid() and record["mode"] == 0o700 == cache.directory.stat().st_mode & 0o777
    assert not list(cache.directory.glob("build-*"))  # the scratch directory (torch's ninja files) is gone
    again = KernelCache(cache.directory, NAME, refuse_to_compile)  # another process, another virtualenv
    assert again.load().version == 1 and again.built_seconds is None


@pytest.mark.parametrize("recorded", [False, True], ids=["no-record", "record-of-another-file"])
def test_a_foreign_library_is_rebuilt_and_never_opened(tmp_path, libraries, caplog, recorded):
    directory = tmp_path / "cache" / NAME
    if recorded:
        built_cache(tmp_path, libraries)
    else:
        directory.mkdir(parents=True, mode=0o700)
    shutil.copyfile(libraries["evil"], directory / f"{NAME}.so")
    compile = FakeCompile(libraries["good"])
    with caplog.at_level(logging.WARNING, logger=quant_cpp.__name__):
        assert KernelCache(directory, NAME, compile).load().version == 1
    assert not libraries["marker"].exists(), "the foreign library's constructor ran"
    assert compile.calls == 1 and file_sha256(directory / f"{NAME}.so") == file_sha256(libraries["good"])
    if recorded:
        assert "bytes, not the" in caplog.text and "rebuilding them" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "removed"])
def test_a_damaged_library_is_rebuilt(tmp_path, libraries, caplog, damage):
    cache, _ = built_cache(tmp_path, libraries)
    data = cache.library.read_bytes()
    if damage == "truncated":  # loading it would fault (SIGBUS) past its end
        cache.library.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":  # same size: only the hash tells
        cache.library.write_bytes(bytes(len(data)))
    else:
        cache.library.unlink()
    compile = FakeCompile(libraries["good"])
    with caplog.at_level(logging.WARNING, logger=quant_cpp.__name__):
        assert KernelCache(cache.directory, NAME, compile).load().version == 1
    assert compile.calls == 1 and "rebuilding" in caplog.text
    assert KernelCache(cache.directory, NAME, refuse_to_compile).problem() is None


def test_a_directory_others_can_write_is_made_private_and_rebuilt(tmp_path, libraries, caplog):
    cache, _ = built_cache(tmp_path, libraries)
    cache.directory.chmod(0o777)
    compile = FakeCompile(libraries["good"])
    with caplog.at_level(logging.WARNING, logger=quant_cpp.__name__):
        KernelCache(cache.directory, NAME, compile).load()
    assert compile.calls == 1 and "others could write to" in caplog.text
    assert cache.directory.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_of_another_user_is_refused(tmp_path, libraries):
    cache, _ = built_cache(tmp_path, libraries)
    os.chown(cache.directory, 12345, 12345)
    with pytest.raises(PermissionError, match=f"kernel cache {re.escape(str(cache.directory))} belongs to uid 12345"):
        KernelCache(cache.directory, NAME, refuse_to_compile).load()


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path, libraries):
    """A builder killed (-9) while holding the lock leaves the file, not the lock."""
    directory = tmp_path / "cache" / NAME
    directory.mkdir(parents=True, mode=0o700)
    lock = directory / "lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
         "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError):  # held while it lives
            KernelCache(directory, NAME, FakeCompile(libraries["good"]), lock_timeout=0.3).load()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.read_text() == str(holder.pid)  # the file stays behind, as would its scratch directory:
    (directory / "build-killed").mkdir()
    compile = FakeCompile(libraries["good"])
    assert KernelCache(directory, NAME, compile, lock_timeout=0.3).load().version == 1 and compile.calls == 1
    assert not (directory / "build-killed").exists()


def test_a_held_lock_times_out_with_a_line_naming_the_file_and_its_holder(tmp_path, caplog):
    lock = tmp_path / "lock"
    held = rf"the test lock {re.escape(str(lock))} is still held by process {os.getpid()} after 0\.3 s"

    def take(timeout: float) -> None:
        with held_lock(lock, timeout, "the test lock"):
            pass

    with held_lock(lock, 1.0, "the test lock"), caplog.at_level(logging.WARNING), pytest.raises(TimeoutError,
                                                                                                match=held):
        take(0.3)
    assert f"waiting for the test lock {lock}, held by process {os.getpid()}" in caplog.text
    take(0.3)  # released when its block ended


def test_the_build_key_names_torch_and_python_not_the_environment(monkeypatch):
    key = quant_cpp.build_key()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    monkeypatch.setenv("VIRTUAL_ENV", "/elsewhere/venv")
    assert quant_cpp.build_key() == key
    monkeypatch.setattr(quant_cpp.torch, "__version__", "0.0.0")
    assert quant_cpp.build_key() != key


def test_rdepth_info_builds_the_kernels_ahead(tmp_path, libraries, monkeypatch, capsys):
    from recurrent_depth.cli import main

    compile = FakeCompile(libraries["good"])
    monkeypatch.setattr(quant_cpp, "kernel_cache", lambda: KernelCache(tmp_path / NAME, NAME, compile))
    for fresh in ("_module", "_failure", "_cache"):
        monkeypatch.setattr(quant_cpp, fresh, None)
    assert main(["info", "--build-kernels"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"kernels: built in \d+\.\d s, in {re.escape(str(tmp_path / NAME))}", out)
    assert "C++ decode kernels: off (RDEPTH_NO_CPP_DECODE or RDEPTH_NO_CPP is set)" in out
    monkeypatch.setattr(quant_cpp, "_module", None)
    assert main(["info", "--build-kernels"]) == 0
    assert "kernels: already built, in" in capsys.readouterr().out and compile.calls == 1


def test_rdepth_info_says_in_one_line_why_the_kernels_cannot_build(tmp_path, monkeypatch, capsys):
    from recurrent_depth.cli import main

    def no_compiler(name: str, scratch: Path):
        raise RuntimeError("Error building extension 'rdepth_fake_kernel'\nc++: not found")

    monkeypatch.setattr(quant_cpp, "kernel_cache", lambda: KernelCache(tmp_path / NAME, NAME, no_compiler))
    for fresh in ("_module", "_failure", "_cache"):
        monkeypatch.setattr(quant_cpp, fresh, None)
    assert main(["info", "--build-kernels"]) == 1
    err = capsys.readouterr().err
    assert err == ("rdepth info: error: the C++ quantized-KV kernels cannot build here: RuntimeError: Error building "
                   "extension 'rdepth_fake_kernel': c++: not found\n")  # (the compiler's reason, not its command)


def test_the_first_compile_of_a_process_says_so_with_its_time(monkeypatch, caplog):
    """The compiled path (RDEPTH_NO_CPP=1) compiles at the first decode call: a message before, and its time after."""
    import torch

    from recurrent_depth.accel.quant import CodeKernels

    def _double_rows(x):
        return 2 * x

    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    kernels = CodeKernels(compile=True, cpp=False)
    with caplog.at_level(logging.WARNING, logger="recurrent_depth.accel.quant"):
        assert kernels._run(_double_rows, 3) == 6 and kernels._run(_double_rows, 4) == 8
    assert caplog.messages[0] == "compiling the quantized-KV double rows kernel (torch.compile, once per process)"
    assert re.fullmatch(r"compiled the quantized-KV double rows kernel in \d+\.\d s", caplog.messages[1])
    assert len(caplog.messages) == 2
