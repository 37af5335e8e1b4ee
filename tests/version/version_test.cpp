// The GRADACCUM_VERSION_* macros are checked in (so a bare `-I include` works) and must equal the
// `version:` of the root meson.build, which the build passes in as GRADACCUM_EXPECTED_VERSION_*.
#include <gradaccum/version.hpp>

#include <cstdio>
#include <string_view>

int main() {
  constexpr std::string_view header_version = GRADACCUM_VERSION_STRING;
  constexpr std::string_view project_version = GRADACCUM_EXPECTED_VERSION_STRING;
  const bool agree = header_version == project_version && GRADACCUM_VERSION_MAJOR == GRADACCUM_EXPECTED_VERSION_MAJOR &&
                     GRADACCUM_VERSION_MINOR == GRADACCUM_EXPECTED_VERSION_MINOR &&
                     GRADACCUM_VERSION_PATCH == GRADACCUM_EXPECTED_VERSION_PATCH &&
                     GRADACCUM_VERSION == GRADACCUM_EXPECTED_VERSION_MAJOR * 10000 +
                                              GRADACCUM_EXPECTED_VERSION_MINOR * 100 + GRADACCUM_EXPECTED_VERSION_PATCH;
  if (!agree) {
    std::fprintf(stderr, "include/gradaccum/version.hpp says %d.%d.%d (\"%s\", %d) but meson.build says %s\n",
                 GRADACCUM_VERSION_MAJOR, GRADACCUM_VERSION_MINOR, GRADACCUM_VERSION_PATCH, GRADACCUM_VERSION_STRING,
                 GRADACCUM_VERSION, GRADACCUM_EXPECTED_VERSION_STRING);
    return 1;
  }
  return 0;
}
