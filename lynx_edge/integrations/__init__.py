"""Integrations of lynx-edge into other inference engines.

`vllm`: LYNX as a vLLM general plugin (`lynx_edge.integrations.vllm:register`). Each integration
imports its engine lazily, so importing lynx-edge never needs vLLM installed.
"""
