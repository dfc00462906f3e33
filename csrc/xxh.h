/* The engine's XXH3 entry points for long inputs (chunk checksums and digests).
 *
 * Debian's libxxhash also exports XXH3 functions that choose AVX2 or AVX-512 at
 * run time (xxh_x86dispatch); its plain ones are built for SSE2 and hash about
 * half as fast.  These wrappers use the dispatching ones when the library has
 * them (weak references, resolved at load time) and the plain ones otherwise.
 * Both compute the same values.
 */
#ifndef CKPTFMT_XXH_H
#define CKPTFMT_XXH_H

#include <stddef.h>
#include <xxhash.h>

XXH128_hash_t ckf_xxh3_128(const void *input, size_t len);
XXH_errorcode ckf_xxh3_128_update(XXH3_state_t *state, const void *input, size_t len);
XXH_errorcode ckf_xxh3_64_update(XXH3_state_t *state, const void *input, size_t len);

#endif
