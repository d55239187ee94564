"""Every read mlxd makes of the Hugging Face hub's files: from local files only, never the network.

The one place that decides mlxd is offline (rather than an HF_HUB_OFFLINE set
in one process and read in another): models come from a path or the local
cache (`hf download` fills it), tokenizers from the directory the engine names.
"""

from __future__ import annotations

import os


def load_tokenizer(directory: str | os.PathLike):
    """transformers' AutoTokenizer of ``directory``, read without any network access."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Its warnings (e.g. about a model's max length) speak of training, not of serving.
    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def cached_snapshot(repo_id: str) -> str:
    """The local snapshot directory of ``repo_id``; huggingface_hub's errors when it is not cached."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, local_files_only=True)
