// The one file of test_extern_templates that compiles the windows the test declares extern.
#include "extern_templates_backends.hpp"

GRADACCUM_INSTANTIATE_TEMPLATES(EXTERN_TEMPLATES_BACKENDS)
