"""`skippy-scheduler export-hf-tokenizer M.gguf DIR`: the Hugging Face folder Dynamo needs.

Writes tokenizer.json, tokenizer_config.json (chat template, BOS/EOS), config.json and
generation_config.json from the GGUF's metadata, then tokenizes a built-in test set with both
llama.cpp and the written tokenizer and refuses (status 2, the counts in the message) where
they differ (skippy_scheduler/dynamo/hf_export.py). Needs the `llama` extra and `tokenizers`
(in the `dynamo` extra).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from ._common import CommandError, check_gguf, positive_int


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export-hf-tokenizer",
        help="write a GGUF's tokenizer as a Hugging Face folder (for Dynamo), checked against "
             "llama.cpp",
        usage="%(prog)s GGUF DIR [--max-length N] [--no-check]",
        description="Write tokenizer.json, tokenizer_config.json (the chat template serve "
                    "uses, BOS/EOS), config.json and generation_config.json for GGUF into DIR "
                    "(made if missing), then check that the written tokenizer tokenizes a "
                    "built-in test set exactly as llama.cpp does; refuse (status 2) where it "
                    "does not. Dynamo's frontend takes DIR as --model-path.")
    p.add_argument("gguf", metavar="GGUF", help="the model file")
    p.add_argument("folder", metavar="DIR", help="folder to write (files in it are replaced)")
    p.add_argument("--max-length", type=positive_int, default=None, metavar="N",
                   help="the context length the folder reports (default: the GGUF's training "
                        "context)")
    p.add_argument("--no-check", action="store_true",
                   help="write the folder without comparing it with llama.cpp's tokenizer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_gguf("GGUF", args.gguf)
    if os.path.exists(args.folder) and not os.path.isdir(args.folder):
        raise CommandError(f"DIR: {args.folder} exists and is not a directory")
    missing = []
    for module in ("gguf", "llama_cpp", "tokenizers"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise CommandError(f"exporting a tokenizer needs {', '.join(missing)}; install them "
                           "from the checkout with: pip install '.[llama]' tokenizers")
    from ..dynamo.hf_export import ExportMismatch, UnsupportedTokenizer, export_folder
    from ..hosts.offload import ModelFileError

    try:
        exported = export_folder(args.gguf, args.folder, max_length=args.max_length,
                                 check=not args.no_check)
    except ModelFileError as exc:  # refused before anything is written, as `run` refuses it
        raise CommandError(f"GGUF: {exc}") from None
    except (UnsupportedTokenizer, ExportMismatch) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {args.folder}: {exc}") from None
    check = ("not checked" if args.no_check else exported.check.line())
    print(f"{exported.folder}\t{', '.join(exported.files)}\tchat template "
          f"{exported.chat_template_source}\t{check}")
    return 0
