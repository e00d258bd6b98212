"""The small trained model that ships inside the package: the offline default."""
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_MODEL = str(DATA_DIR / "tiny-shakespeare")  # a Hugging Face GPT-2 directory; see scripts/train_tiny.py
HELDOUT_TEXT = DATA_DIR / "heldout.txt"  # text from validation plays the model never trained on
