//! `GET /v1/responses/{id}/input_items`: the input items of a stored response's own request (its
//! `input`; neither its `instructions` nor the turns of its `previous_response_id`), a page at a
//! time as OpenAI lists them: `limit` (1 to 100, 20 by default), `order` (`desc` by default) and
//! `after` (the id of the item that the page follows, in that order).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::Json;
use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::responses::stored_response;
use crate::api::validate::out_of_range;
use crate::state::AppState;
use sluice_common::schema::responses::InputItemList;

const DEFAULT_LIMIT: usize = 20;
const MAX_LIMIT: usize = 100;

/// A valid request for a page.
#[derive(Debug, Clone, PartialEq)]
struct PageQuery {
    limit: usize,
    ascending: bool,
    after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`.
pub async fn list(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Json<InputItemList>, ApiError> {
    let query = page_query(pairs)?;
    let stored = stored_response(&state.responses, &id, None)?;
    let items: Vec<Value> = serde_json::from_str(&stored.input_items).map_err(|error| {
        ApiError::Internal(format!(
            "the stored input items of {id} do not read back: {error}"
        ))
    })?;
    page(items, &query).map(Json)
}

/// The query parameters as a page request; `include` (no extra data is kept) and any parameter
/// OpenAI does not define are a 400 naming them.
fn page_query(pairs: Vec<(String, String)>) -> Result<PageQuery, ApiError> {
    let mut query = PageQuery {
        limit: DEFAULT_LIMIT,
        ascending: false,
        after: None,
    };
    for (name, value) in pairs {
        match name.as_str() {
            "limit" => {
                query.limit = value
                    .parse()
                    .ok()
                    .filter(|limit| (1..=MAX_LIMIT).contains(limit))
                    .ok_or_else(|| {
                        out_of_range(
                            "limit",
                            format!(
                                "limit must be a whole number from 1 to {MAX_LIMIT}, got {value:?}"
                            ),
                        )
                    })?
            }
            "order" => {
                query.ascending = match value.as_str() {
                    "asc" => true,
                    "desc" => false,
                    _ => {
                        return Err(out_of_range(
                            "order",
                            format!("order must be asc or desc, got {value:?}"),
                        ))
                    }
                }
            }
            "after" => query.after = Some(value),
            "include" | "include[]" => {
                return Err(out_of_range(
                    "include",
                    format!(
                        "include {value:?} is not served: no extra data (image urls, logprobs, \
                         encrypted reasoning) is kept with the items"
                    ),
                ))
            }
            _ => {
                return Err(ApiError::InvalidRequest(format!(
                    "the query parameter {name:?} is not served here; the parameters are limit, \
                     order, after and include"
                )))
            }
        }
    }
    Ok(query)
}

/// One page of `items`, which are in their input's order.
fn page(mut items: Vec<Value>, query: &PageQuery) -> Result<InputItemList, ApiError> {
    if !query.ascending {
        items.reverse();
    }
    let start = match &query.after {
        Some(after) => {
            let at = items
                .iter()
                .position(|item| id_of(item) == Some(after.as_str()))
                .ok_or_else(|| {
                    out_of_range(
                        "after",
                        format!("no input item of this response has the id {after:?}"),
                    )
                })?;
            at + 1
        }
        None => 0,
    };
    let has_more = items.len() > start + query.limit;
    let data: Vec<Value> = items.into_iter().skip(start).take(query.limit).collect();
    let first_last = |item: Option<&Value>| item.and_then(id_of).map(str::to_owned);
    Ok(InputItemList {
        object: "list".into(),
        first_id: first_last(data.first()),
        last_id: first_last(data.last()),
        has_more,
        data,
    })
}

fn id_of(item: &Value) -> Option<&str> {
    item.get("id").and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn query(pairs: &[(&str, &str)]) -> Result<PageQuery, ApiError> {
        page_query(
            pairs
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect(),
        )
    }

    fn items(count: usize) -> Vec<Value> {
        (0..count)
            .map(|at| json!({"id": format!("msg_{at}")}))
            .collect()
    }

    fn ids(list: &InputItemList) -> Vec<&str> {
        list.data.iter().filter_map(id_of).collect()
    }

    #[test]
    fn pages_go_newest_first_by_default_and_follow_their_after() {
        let first = page(items(5), &query(&[("limit", "2")]).unwrap()).unwrap();
        assert_eq!(ids(&first), ["msg_4", "msg_3"]);
        assert_eq!(first.first_id.as_deref(), Some("msg_4"));
        assert_eq!(first.last_id.as_deref(), Some("msg_3"));
        assert!(first.has_more);
        let next = query(&[("limit", "2"), ("after", "msg_3")]).unwrap();
        assert_eq!(ids(&page(items(5), &next).unwrap()), ["msg_2", "msg_1"]);
        let last = page(items(5), &query(&[("after", "msg_1")]).unwrap()).unwrap();
        assert_eq!((ids(&last), last.has_more), (vec!["msg_0"], false));
        let ascending = query(&[("order", "asc"), ("after", "msg_1"), ("limit", "3")]).unwrap();
        let list = page(items(5), &ascending).unwrap();
        assert_eq!(
            (ids(&list), list.has_more),
            (vec!["msg_2", "msg_3", "msg_4"], false)
        );
        let all = page(items(3), &query(&[]).unwrap()).unwrap();
        assert_eq!((all.data.len(), all.has_more), (3, false));
        let none = page(Vec::new(), &query(&[]).unwrap()).unwrap();
        assert_eq!(
            (none.first_id, none.last_id, none.has_more),
            (None, None, false)
        );
        let unknown = page(items(2), &query(&[("after", "msg_9")]).unwrap()).unwrap_err();
        assert_eq!(unknown.param(), Some("after"));
    }

    #[test]
    fn limits_orders_include_and_unknown_parameters_are_refused_by_name() {
        assert_eq!(
            query(&[]).unwrap(),
            PageQuery {
                limit: 20,
                ascending: false,
                after: None
            }
        );
        assert_eq!(query(&[("limit", "100")]).unwrap().limit, 100);
        for (name, value, param) in [
            ("limit", "0", Some("limit")),
            ("limit", "101", Some("limit")),
            ("limit", "x", Some("limit")),
            ("order", "up", Some("order")),
            ("include", "message.input_image.image_url", Some("include")),
            ("include[]", "reasoning.encrypted_content", Some("include")),
            ("before", "msg_1", None),
        ] {
            let error = query(&[(name, value)]).unwrap_err();
            assert_eq!(error.status().as_u16(), 400, "{name}={value}");
            assert_eq!(error.param(), param, "{name}={value}");
            assert!(error.to_string().contains(value) || error.to_string().contains(name));
        }
    }
}
