"""Training data: token shards, how a run reads and records them, and the tools that make them (docs/data.md).
Nothing is imported here:

    data.shards       the token shard format (llm.c and modded-nanogpt's): writing, and reading with every check
    data.loader       distributed, resumable batches from shards, the same rows on any number of ranks; validation
    data.lookup       which shards a run trains and validates on, and the record config.json and checkpoints keep
    data.tokenizer    the GPT-2 tokenizer without internet access: a verified copy of its rank file
    data.documents    documents from text, jsonl and parquet files or a Hugging Face dataset, nothing dropped silently
    data.tokenize     documents to GPT-2 token shards on all cores, with a manifest (`python -m data.tokenize`)
    data.embedded     the default corpus, a pinned text shipped in data/embedded_corpus/, tokenized offline
    data.fineweb_edu  the pre-tokenized FineWeb-Edu 10B shards from the Hub: resumable, every file validated
"""
