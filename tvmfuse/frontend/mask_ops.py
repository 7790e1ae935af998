"""Converter overrides for the ops exporters emit to build attention masks (CumSum, GatherND, IsNaN, Where)."""

from __future__ import annotations

from tvm.relax.frontend.onnx import onnx_frontend as _tvm

OVERRIDES: dict[str, type] = {}
