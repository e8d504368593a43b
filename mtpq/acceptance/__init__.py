"""Engine-neutral reports and gates: what the torch runtime and llama.cpp measure, judged the same way."""
