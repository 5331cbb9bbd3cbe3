"""Real pretrained models from GGUF files: packaged ones by short name, conversion into the cache.

docs/real_models.md. ``model: pypi:smollm2-135m-instruct``, ``model: path/to/file.gguf`` or
``class_path: mrl_lightning.gguf.GGUFModel``; the file is converted once into an ordinary
``save_pretrained`` folder in the model cache (``$MRL_CACHE_DIR``).
"""

from mrl_lightning.gguf.files import GGUFFileError, read_header, sha256_of
from mrl_lightning.gguf.packaged import PACKAGED, PackagedGGUF
from mrl_lightning.gguf.source import GGUFModel, model_from_string

__all__ = ["GGUFFileError", "GGUFModel", "PACKAGED", "PackagedGGUF", "model_from_string", "read_header", "sha256_of"]
