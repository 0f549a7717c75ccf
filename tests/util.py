"""Shared test helpers."""
import torch
from transformers import LlamaForCausalLM


def hf_model(config, seed=0):
    """A Hugging Face Llama with random fp32 weights, in eval mode, on the CPU."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
