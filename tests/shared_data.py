"""The shared corpora some tests read (``../shared/data`` beside the project, or ``QKV_DATA``), and the one reason
every such test gives when they are absent: which files, where, and where docs/testing.md says to fetch them."""

from pathlib import Path

from clitools import DATA

# What the tests read of them (docs/testing.md#the-shared-corpora).
CORPORA = (*(f"multi30k/{split}.{lang}.gz" for split in ("train", "val", "test_2016_flickr") for lang in ("de", "en")),
           "tatoeba-en-zh/cmn.txt", "tinyshakespeare/input.txt")


def missing_corpora(data: Path = DATA) -> str | None:
    """Why the tests that read the shared corpora cannot run (a skip's reason), or None where they can."""
    absent = [name for name in CORPORA if not (data / name).is_file()]
    if not absent:
        return None
    shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
    return (f"the shared corpora are not under {data} ({shown} missing): fetch them as docs/testing.md#the-shared-"
            "corpora says, into that folder or one that QKV_DATA names")
