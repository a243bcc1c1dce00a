"""SGLang's native HTTP wire format: `request` (what `POST /generate` accepts) and `response` (what it
answers, and what the trainer reads). Pure Python: importing it loads neither torch nor the engine."""
