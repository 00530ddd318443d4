"""``qkv serve``: a language model behind OpenAI's HTTP API (:mod:`.app`), continuing prompts as ``qkv generate``
does (:mod:`.engine`), each request checked field by field first (:mod:`.protocol`). Needs ``starlette`` and
``uvicorn`` (``pip install 'qkv[serve]'``)."""
