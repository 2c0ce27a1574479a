"""Models a user brings or the project builds: Llama, BERT/GPT-2 blocks, trained PP-OCR, light models, mixtures of experts, MLA."""
