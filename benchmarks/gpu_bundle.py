"""What travels with the checkout to an offline GPU machine for `python -m benchmarks.gpu`, and its setup
there.

The machine planned for: one H100 / H200, CUDA 13, Python 3.12 with torch, triton, transformers 5.17,
accelerate,
pytest and numpy preinstalled; no network; at most 64 MiB per command (working tree and carried folders
together). The bundle (`make gpu-wheels` writes it; an ignored folder) holds:

    .gpu/bundle/wheels/       WHEELS, downloaded for CPython 3.12 manylinux x86_64, no dependencies
    .gpu/bundle/hf-attn/      the embedded text (Austen, Python docs) and SmolLM2's config and tokenizer,
                              without its weights (517 MB): the parts that need SmolLM2 use random weights
    .gpu/bundle/manifest.json file names, sizes, sha256 and the size account against the limit

On the GPU machine the runner installs the wheels with `pip install --no-index --no-deps --no-compile --target
.gpu/site/wheels` and builds `.gpu/site/src/hf_attn`, the installed package layout (`hf_attn.eval`,
`hf_attn.conversion`) made of symbolic links into the checkout, with `.gpu/site/src/benchmarks` (a link to the
checkout's `benchmarks/`) beside it, so an edit in the checkout is what runs next. Child processes get both on
PYTHONPATH, with PYTHONSAFEPATH=1 so that the checkout's own `hf_attn/` folder
(which lacks `eval` and `conversion`) does not shadow them. Standard library (and `packaging`) only: the
runner imports this before any package that the wheels replace.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (benchmarks/ is never installed)
BUNDLE = ".gpu/bundle"  # relative to the checkout; the folder a GPU rental carries
SITE = ".gpu/site"  # installed wheels and the package layout; built on the GPU machine, never carried
SIZE_LIMIT = 64 * 2**20  # bytes per command: working tree + carried folders
PYTHON_VERSION, PLATFORMS = "3.12", ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# (distribution, version, why it must travel): what the suite needs beyond the machine's preinstalled packages
WHEELS = (
    ("transformers", "5.24.0", "the project needs >= 5.23 (pyproject); the machine has 5.17"),
    ("huggingface-hub", "1.33.0", "transformers 5.24 needs >= 1.31; the 1.x line keeps the machine's httpx"),
    ("hf-xet", "1.8.0", "huggingface-hub 1.33 needs >= 1.6"),
    ("click", "8.5.1", "huggingface-hub 1.33 needs >= 8.4.2"),
)
# SmolLM2 files that travel (no weights) and text folders, relative to the hf-attn cache
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
TEXT_DIRS = ("austen", "python-docs")


def bundle_dir(root: Path = ROOT) -> Path:
    return root / BUNDLE


def site_dir(root: Path = ROOT) -> Path:
    return root / SITE


def is_checkout(root: Path = ROOT) -> bool:
    """Whether the runner runs from a source checkout (else from an installed package)."""
    return (root / "pyproject.toml").is_file() and (root / "hf_attn" / "__init__.py").is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes(root: Path = ROOT) -> tuple[int, dict[str, int]]:
    """Bytes of the tracked files, and of the untracked, not ignored ones by top-level entry: a rental copies
    both besides the carried folders (the second are work in progress: ignore or remove them before one)."""

    def listed(*flags: str) -> list[Path]:
        out = subprocess.run(["git", "ls-files", "-z", *flags], cwd=root, capture_output=True, check=True)
        return [root / name for name in out.stdout.decode().split("\0") if name]

    tracked = sum(p.stat().st_size for p in listed("--cached") if p.is_file())
    untracked: dict[str, int] = {}
    for p in listed("--others", "--exclude-standard"):
        if p.is_file():
            top = p.relative_to(root).parts[0]
            untracked[top] = untracked.get(top, 0) + p.stat().st_size
    return tracked, untracked


def check_wheel_list(root: Path = ROOT) -> list[str]:
    """Problems of WHEELS against the project's own requirement on transformers (pyproject.toml)."""
    import tomllib

    from packaging.requirements import Requirement

    problems = []
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {Requirement(r).name: Requirement(r) for r in project}
    for name, version, _ in WHEELS:
        if name in wanted and not wanted[name].specifier.contains(version):
            problems.append(f"{name}=={version} does not satisfy the project's {wanted[name]}")
    if "transformers" not in {name for name, _, _ in WHEELS}:
        problems.append("transformers is missing from the wheel list")
    return problems


def check_bundle(bundle: Path) -> list[str]:
    """Problems of a fetched bundle: wheels missing or changed, or the manifest's size over the limit."""
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        return [f"{bundle} has no manifest.json; run `make gpu-wheels`"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    pinned = {(n.replace("-", "_").lower(), v) for n, v, _ in WHEELS}
    listed = {(w["name"].replace("-", "_").lower(), w["version"]) for w in manifest["wheels"]}
    if listed != pinned:
        problems.append(f"the bundle's wheels {sorted(listed)} differ from the list {sorted(pinned)}")
    for w in manifest["wheels"]:
        path = bundle / "wheels" / w["file"]
        if not path.is_file() or path.stat().st_size != w["bytes"]:
            problems.append(f"wheel {w['file']} is missing or changed; run `make gpu-wheels`")
    if manifest["total_bytes"] > SIZE_LIMIT:
        problems.append(f"bundle + working tree {manifest['total_bytes'] / 2**20:.1f} MiB > 64 MiB")
    return problems


# --------------------------------------------------------------------------------------------- fetch (here)


def download_wheels(dest: Path) -> list[dict]:
    """Download WHEELS (CPython 3.12, manylinux x86_64, no dependencies) into the new folder `dest`."""
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON_VERSION, "--implementation", "cp", "--dest", str(dest)]  # fmt: skip
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    argv += [f"{name}=={version}" for name, version, _ in WHEELS]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"pip download failed (exit {proc.returncode}): {tail}")
    wheels = []
    for path in sorted(dest.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        wheels.append(dict(file=path.name, name=name, version=version, bytes=path.stat().st_size,
                           sha256=_sha256(path)))  # fmt: skip
    return wheels


def copy_assets(dest: Path, cache: Path) -> int:
    """Copy the travelling part of the hf-attn cache `cache` into `dest`; returns its bytes."""
    for name in TEXT_DIRS:
        shutil.copytree(cache / name, dest / name)
    (dest / "smollm2-135m-instruct").mkdir(parents=True)
    for name in SMOLLM2_FILES:
        shutil.copy2(cache / "smollm2-135m-instruct" / name, dest / "smollm2-135m-instruct" / name)
    return _folder_bytes(dest)


def fetch(root: Path = ROOT) -> dict:
    """Write the bundle (wheels, assets, manifest) into `root/.gpu/bundle`, replacing a former one; the
    manifest's account of bytes against SIZE_LIMIT. ValueError when the total is over the limit."""
    from hf_attn.tooling import assets

    problems = check_wheel_list(root)
    if problems:
        raise ValueError("; ".join(problems))
    assets.austen_dir(), assets.python_docs_dir(), assets.smollm2_dir()  # fetched here if missing
    final = bundle_dir(root)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bundle.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        wheels = download_wheels(tmp / "wheels")
        asset_bytes = copy_assets(tmp / "hf-attn", assets.cache_dir())
        wheel_bytes = sum(w["bytes"] for w in wheels)
        tree, untracked = tree_bytes(root)
        manifest = dict(
            wheels=wheels, wheel_bytes=wheel_bytes, asset_bytes=asset_bytes, tree_bytes=tree,
            total_bytes=wheel_bytes + asset_bytes + tree, limit_bytes=SIZE_LIMIT, untracked_bytes=untracked,
            why={name: why for name, _, why in WHEELS},
        )  # fmt: skip
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if manifest["total_bytes"] > SIZE_LIMIT:
            raise ValueError(
                f"wheels {wheel_bytes / 2**20:.1f} MiB + assets {asset_bytes / 2**20:.1f} MiB + working tree "
                f"{tree / 2**20:.1f} MiB (tracked files) is over the 64 MiB a command carries; shorten WHEELS"
            )
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


# --------------------------------------------------------------------------------------------- setup (there)


def install_wheels(bundle: Path, site: Path) -> Path | None:
    """`pip install --no-index --no-deps --target` of the bundle's wheels into site/wheels, unless the same
    wheels are installed already; the folder, or None without a bundle."""
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        return None
    target, stamp = site / "wheels", site / "wheels.json"
    key = json.dumps([(w.name, w.stat().st_size) for w in wheels])
    if target.is_dir() and stamp.is_file() and stamp.read_text() == key:
        return target
    if target.exists():
        shutil.rmtree(target)
    # --no-compile: no bytecode for all of transformers up front; each import compiles what it uses
    pip = ["pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    argv = [sys.executable, "-m", *pip, "--target", str(target)]
    proc = subprocess.run(argv + [str(w) for w in wheels], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"pip install --target {target} failed (exit {proc.returncode}): {tail}")
    stamp.write_text(key)
    return target


def package_layout(root: Path, site: Path) -> Path:
    """site/src/hf_attn: the installed layout of the checkout (hf_attn/*, eval -> hf_attn.eval, conversion ->
    hf_attn.conversion) as symbolic links, and site/src/benchmarks beside it; rebuilt on every call. Returns
    site/src (for PYTHONPATH)."""
    src = site / "src"
    if src.exists():
        shutil.rmtree(src)
    package = src / "hf_attn"
    package.mkdir(parents=True)
    for entry in (root / "hf_attn").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "eval").symlink_to(root / "eval")
    (package / "conversion").symlink_to(root / "conversion")
    (src / "benchmarks").symlink_to(root / "benchmarks")  # the parts' modules, beside the package
    return src


def child_env(root: Path = ROOT, *, install: bool = True) -> dict[str, str]:
    """Environment of the parts' child processes (module docstring); `install`: the bundle's wheels too."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    if not is_checkout(root):
        return env  # an installed hf-attn: its environment as it is
    site, bundle = site_dir(root), bundle_dir(root)
    paths = [str(package_layout(root, site))]
    wheels = install_wheels(bundle, site) if install else None
    if wheels is not None:
        paths.append(str(wheels))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONSAFEPATH="1")
    default_cache = Path.home() / ".cache" / "hf-attn"
    if "HF_ATTN_CACHE" not in env and not (default_cache / "austen" / "SHA256SUMS").is_file():
        if (bundle / "hf-attn" / "austen").is_dir():
            env["HF_ATTN_CACHE"] = str(bundle / "hf-attn")
    return env
