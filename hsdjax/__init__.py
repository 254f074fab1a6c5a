"""hsdjax: lossless speculative decoding in JAX (hidden-state drafting with draft reuse).

    import hsdjax
    model = hsdjax.load_model("smollm2-135m")
    gen = hsdjax.Generator(model, method="ar")
    print(gen.generate("Write a haiku about JAX.", max_new_tokens=64)[0].text)
"""

from hsdjax.errors import HsdjaxError, ModelNotInstalled
from hsdjax.frontends.api import GenerationResult, Generator, LoadedModel, load_model

__all__ = ["GenerationResult", "Generator", "HsdjaxError", "LoadedModel", "ModelNotInstalled", "load_model"]
__version__ = "0.1.0"
