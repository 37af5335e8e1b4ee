// Compile-cost target (b): mlp_gradaccum.cpp plus one checkpoint of the window and its loss
// scaler, saved and loaded back (the README's save_checkpoint(path, window, scaler) and
// load_checkpoint(path, params, window, scaler)); nothing else differs.
#define WITH_CHECKPOINT
#include "mlp_gradaccum.cpp"
