"""Pure tensor operations with their own autograd. No Hugging Face imports here."""
