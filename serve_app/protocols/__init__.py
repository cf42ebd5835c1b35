"""Wire protocols, one module each: Open Inference Protocol v2 and OpenAI."""
