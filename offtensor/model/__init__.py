"""Layer 7, a whole model: wrap, unwrap, load, summary and the controls; planning the scopes, the guards on
a wrapped model, already-quantized weights, the progress bar. Imports optim/ and below."""
