"""Where the benchmark and training files come from, and where a run reads them.

:data:`MANIFEST`: every file the configs read (``${paths.data_dir}/<local>``), with the GitHub
repository, commit and path it was copied from verbatim, its sha256, size and licence (as in
``../shared/data/*/SOURCE.md``). ``paths.data_dir`` is ``$MEDSRL_DATA_DIR``, else
``<shared_dir>/data``, else (a clone alone, :func:`set_data_dir_default`) ``<repo>/data``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MANIFEST", "DataFile", "data_dir_default", "set_data_dir_default"]

QWEN_MATH = ("QwenLM/Qwen2.5-Math", "a45202bd16f1ec06f433442dc1152d0074773465")
DEEPSCALER = ("agentica-project/deepscaler", "95ef74ffee001cce89463f2d61dfdce1d03576c1")
SIMPLERL_V1 = ("hkust-nlp/simpleRL-reason", "cf1c7858bfc145a27aa733e75d930d34f0d318a6")
SIMPLERL_PR57 = ("hkust-nlp/simpleRL-reason", "bdc9f803c8e0dd749e1aa778d40d012626b01ff6")
SVS = ("MasterVito/SvS", "9fd8f35375b31b8632b52e715296c264a3ad4176")
REPO = ("tmlr-group/RePO", "c2f026fadadb17fb749e7d876fc8b5d4fd66b64f")

MATH_MIT = "data: MATH (Hendrycks et al. 2021), MIT (well-known, not restated in the source repo)"
MAA = "problems (c) Mathematical Association of America"


@dataclass(frozen=True)
class DataFile:
    """One file: ``<data root>/<local>`` is ``<path>`` of github.com/``<repo>`` at ``<commit>``."""

    local: str  # relative to the data root (paths.data_dir), the layout of ../shared/data
    repo: str  # owner/name on GitHub
    commit: str
    path: str  # in the repository
    sha256: str
    size: int  # bytes
    license: str
    note: str = ""

    @property
    def name(self) -> str:
        """The folder: what ``medsrl-data --only`` takes (or ``local`` for one file)."""
        return self.local.split("/", 1)[0]


def _file(local: str, source: tuple[str, str], path: str, sha256: str, size: int,
          license: str, note: str = "") -> DataFile:
    return DataFile(local, source[0], source[1], path, sha256, size, license, note)


def _deepscaler_eval(name: str, sha256: str, size: int, license: str) -> DataFile:
    return _file(f"deepscaler_eval/{name}", DEEPSCALER, f"deepscaler/data/test/{name}", sha256,
                 size, f"repo MIT; {license}")


MANIFEST: tuple[DataFile, ...] = (
    # training (configs/data/math.yaml, deepscaler.yaml)
    _file("math_train/math.json", DEEPSCALER, "deepscaler/data/train/math.json",
          "569230b362fd501e1a33d8f29aae3b4b989d32e2b91b07c3f48493528c3bf6d2", 2385902,
          f"repo MIT; {MATH_MIT}"),
    _file("dapo_math_17k/dapo_math_17k.parquet", SVS, "data/dapo_math_17k.parquet",
          "246ae23df97c9eae8126cb4da780e9a0a31d10110e16eed144bcecbf2132d535", 2773999,
          "repo Apache-2.0; DAPO-Math-17k Apache-2.0 per its HF dataset card (well-known)"),
    _file("simplelr_math_35/train.parquet", SIMPLERL_PR57, "train.parquet",
          "a6ce0b30da9d3be80b0bd8b2925c8707aec6f627af3628c5439241a3b22e7c13", 3805836,
          f"repo MIT; {MATH_MIT}",
          "commit reachable only from refs/pull/57/head (a contributor pull request), no branch; "
          "a community copy of hkust-nlp/SimpleRL-Zoo-Data simplelr_qwen_level3to5"),
    _file("deepscaler_train_aime/aime.json", DEEPSCALER, "deepscaler/data/train/aime.json",
          "78f1b9bae6d00794b43e79a5842917f7ef4e355d9b705743c61f255f3c7c5d49", 1289048,
          f"repo MIT; {MAA}"),
    # no config reads it: kept so that the manifest covers ../shared/data
    _file("math_train_verl/train.parquet", REPO, "data/math/train.parquet",
          "7aadb17b2f8a6a96e73dfbe74b381d80c7a692b80fc7c17301b2c21b8c17a5a3", 1041234,
          f"no licence file in the repo; {MATH_MIT}"),
    # benchmarks (configs/benchmark/*.yaml; aime24 also data=math's validation)
    _file("aime24/test.jsonl", QWEN_MATH, "evaluation/data/aime24/test.jsonl",
          "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac", 156944,
          f"none stated for the data; {MAA}, text from the AoPS wiki; repo's evaluation/LICENSE "
          "MIT (code)"),
    _file("amc23/test.jsonl", QWEN_MATH, "evaluation/data/amc23/test.jsonl",
          "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4", 27631,
          f"none stated; {MAA}; repo's evaluation/LICENSE MIT (code)"),
    _file("math500/test.jsonl", SIMPLERL_V1, "examples/simplelr_math_eval/data/math500/test.jsonl",
          "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132", 446564,
          f"repo MIT; {MATH_MIT}; the 500-problem split from openai/prm800k (MIT)"),
    _file("minerva_math/test.jsonl", QWEN_MATH, "evaluation/data/minerva_math/test.jsonl",
          "0e656b430d3a0a1dab6aa853f453ba3805e28e2cabe4fc72486a897cc09d8ba2", 247267,
          "not stated in the repo; MIT OpenCourseWare content, CC BY-NC-SA 4.0 (well-known, "
          "not verified)"),
    _file("olympiadbench/test.jsonl", QWEN_MATH, "evaluation/data/olympiadbench/test.jsonl",
          "bb8c1e38a16ea9eacb77530315a674d883f267fbff79183effc53681b4fcc416", 1493870,
          "not stated in the repo; OlympiadBench Apache-2.0 per its HF dataset card (well-known)"),
    _file("gsm8k/test.jsonl", QWEN_MATH, "evaluation/data/gsm8k/test.jsonl",
          "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394", 761421,
          "not stated in the repo; GSM8K (openai/grade-school-math) MIT (well-known)"),
    _deepscaler_eval("aime.json", "03fd341fee10fb71cf906be4eb3042081f314c4d16077489e41f9375085d20d2",
                     38011, MAA),
    _deepscaler_eval("amc.json", "2666a217cb566efb77ebfce61841d5d8855d4b4be89633b29df3a43dcfd942dd",
                     38170, MAA),
    _deepscaler_eval("math.json", "02e232722dd1f9ab307124bfff40621d32193632b6b84aa9a246e701f0478141",
                     172073, "MATH MIT (well-known)"),
    _deepscaler_eval("minerva.json", "ba6147602d8b2f9071ecf578e29aa1100c634bdfa982d4c6745c2bd3077554ba",
                     269352, "Minerva / MIT OCW CC BY-NC-SA (well-known)"),
    _deepscaler_eval("olympiad_bench.json",
                     "c1e099f7b5830fb843fa52d48d0af8a296a94745cb5981b4ce539dd18af6f8ee", 1582347,
                     "OlympiadBench Apache-2.0 (well-known)"),
)


def shared_data_dir(root: Path) -> Path:
    """``<shared_dir>/data`` as the configs default it: ``$MEDSRL_SHARED_DIR``, else ``<root>/../shared``."""
    return Path(os.environ.get("MEDSRL_SHARED_DIR", Path(root) / ".." / "shared")) / "data"


def data_dir_default(root: Path) -> Path | None:
    """``<root>/data`` on a clone without ``$MEDSRL_DATA_DIR`` or the shared data folder, else None."""
    if "MEDSRL_DATA_DIR" in os.environ or shared_data_dir(root).is_dir():
        return None
    return Path(root) / "data"


def set_data_dir_default(root: Path) -> None:
    """For the entry points, before Hydra composes: on a clone alone, ``$MEDSRL_DATA_DIR=<root>/data``."""
    default = data_dir_default(root)
    if default is not None:
        os.environ["MEDSRL_DATA_DIR"] = str(default)
