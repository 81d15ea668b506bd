

def test_an_embedding_model_is_an_encoder_or_one_that_pools() -> None:
    """What runs llama-server in its embedding mode: an encoder's architecture, or a pooling type of
    mean, CLS or last under the model's own architecture; not a reranker's (rank), not none, not another arch's key."""
    from meshllm.llama.gguf import is_embedding_model

    assert is_embedding_model({"general.architecture": "bert"})
    assert is_embedding_model({"general.architecture": "qwen3", "qwen3.pooling_type": 3})
    assert is_embedding_model({"general.architecture": "gemma3", "gemma3.pooling_type": 1})
    assert not is_embedding_model({"general.architecture": "gemma3"})
    assert not is_embedding_model({"general.architecture": "qwen3", "qwen3.pooling_type": 0})
    assert not is_embedding_model({"general.architecture": "qwen3", "qwen3.pooling_type": 4})  # a reranker
    assert not is_embedding_model({"general.architecture": "qwen3", "llama.pooling_type": 1})
    assert not is_embedding_model({})
