"""cqk-megatron: Coupled Query-Key Dynamics and Differential Attention on Megatron-Core.

Ranges here are what a GPU cluster can satisfy (newer torch and megatron-core there);
``constraints.txt`` pins the exact CPU versions that CI and the README's commands use.
"""

from setuptools import find_packages, setup

setup(
    name="cqk-megatron",
    version="0.1.0",
    description="Coupled QK dynamics and Differential Attention at scale on Megatron-Core",
    python_requires=">=3.10",
    packages=find_packages(
        include=["cqk_megatron", "cqk_megatron.*", "data_tools", "data_tools.*", "launch"]
    ),
    install_requires=[
        # torch is installed first and explicitly by scripts/install.sh (a CPU build here);
        # >=2.5 for scaled_dot_product_attention(enable_gqa=...).
        "torch>=2.5",
        "megatron-core>=0.16.1",
        "pyyaml>=6",
        "numpy>=1.24",
        "tqdm>=4.60",
        "sentencepiece>=0.2",
        "datasets>=3.0",
        "pyarrow>=15",
        "submitit>=1.5.4,<1.6",  # launch/ uses submitit's sbatch renderer
        "xxhash>=3",  # checkpoint manifests (xxh3-128); pinned in constraints.txt
    ],
    extras_require={
        "deepspeed": ["deepspeed>=0.16"],
        "logging": ["wandb>=0.17", "tensorboard>=2.14"],
        "hf": [
            "transformers>=5.0,<6",
            "safetensors>=0.4",
            "sentencepiece>=0.2",
            "tokenizers>=0.21",
            "protobuf>=4",
        ],
        "eval": ["lm-eval>=0.4.13", "accelerate>=1.0"],
        "analysis": ["pandas>=2.0", "scipy>=1.11", "matplotlib>=3.7", "threadpoolctl>=3"],
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.6", "mypy>=1.10"],
    },
    entry_points={
        "console_scripts": [
            # one command, `cqk <command>` (cqk_megatron/__main__.py); the cqk-* names
            # below are its old spellings, kept as aliases
            "cqk=cqk_megatron.__main__:main",
            "cqk-params=cqk_megatron.cli.params:main",
            "cqk-train=cqk_megatron.train:main",
            "cqk-torchrun=cqk_megatron.cli.torchrun:main",
            "cqk-plan=cqk_megatron.cli.plan:main",
            "cqk-bench=cqk_megatron.cli.bench:main",
            "cqk-convert=cqk_megatron.cli.convert:main",
            "cqk-train-tokenizer=data_tools.tokenizer:main",
            "cqk-preprocess=data_tools.preprocess:main",
            "cqk-data-stats=data_tools.stats:main",
            "cqk-demo-corpus=data_tools.demo_corpus:main",
            "cqk-data-bench=data_tools.bench:main",
            "cqk-analyze=cqk_megatron.cli.analyze:main",
            "cqk-submit=launch.submit:main",
            "cqk-mqar=cqk_megatron.cli.mqar:main",
            "cqk-repro=cqk_megatron.cli.repro:main",
        ],
    },
)
